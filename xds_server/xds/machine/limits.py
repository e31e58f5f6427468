"""What one stream may ask for and be sent, and the errors that end a stream (the peer's)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_RESOURCE_NAMES = 16_384  # names of one type one stream may subscribe to
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # gRPC clients' default receive limit per message
# Reserved below max_response_bytes for what packing does not count: the envelope fields
# (version, type URL, nonce; well under 300 bytes) and gRPC's 5-byte message prefix.
RESPONSE_HEADROOM = 1024
MAX_REJECTED_VERSIONS = 8  # rejected versions remembered per resource (or whole state) per type


class ProtocolError(Exception):
    """The peer's fault: a request that breaks the xDS protocol."""


class ResourceLimitExceeded(ProtocolError):
    """The peer's fault: a request naming more resources than this server accepts."""


@dataclass(frozen=True)
class StreamLimits:
    """What one stream may ask for and be sent (`xds.limits` in the config)."""

    max_resource_names: int = MAX_RESOURCE_NAMES
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if self.max_resource_names < 1:
            raise ValueError(f"max_resource_names must be >= 1, got {self.max_resource_names}")
        if self.max_response_bytes <= RESPONSE_HEADROOM:
            raise ValueError(f"max_response_bytes must be above {RESPONSE_HEADROOM}, got "
                             f"{self.max_response_bytes}")

    @property
    def part_bytes(self) -> int:
        """The most resource (and removed-name) bytes one response may carry."""
        return self.max_response_bytes - RESPONSE_HEADROOM

