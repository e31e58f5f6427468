"""What one stream may ask for and be sent, and the errors that end a stream (the peer's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields

MAX_RESOURCE_NAMES = 16_384  # names of one type one stream may subscribe to
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # gRPC clients' default receive limit per message
# Reserved below max_response_bytes for what packing does not count: the envelope fields
# (version, type URL, nonce; well under 300 bytes) and gRPC's 5-byte message prefix.
RESPONSE_HEADROOM = 1024
MAX_REJECTED_VERSIONS = 8  # rejected versions remembered per resource (or whole state) per type
# Bytes of resource names (subscribed, and held as initial_resource_versions keys and values)
# one stream may hold, all types together: 13,000 clusters of 60-byte names subscribed to in
# CDS and EDS with 20-byte versions held for both need about 3 MB.
MAX_SUBSCRIPTION_BYTES = 8 * 1024 * 1024
MAX_TYPES = 32  # distinct type URLs one (ADS) stream may request


class ProtocolError(Exception):
    """The peer's fault: a request that breaks the xDS protocol."""


class ResourceLimitExceeded(ProtocolError):
    """The peer's fault: a request naming more resources than this server accepts."""


class FieldTooLarge(ProtocolError):
    """The peer's fault: a request field larger than this server accepts."""


@dataclass(frozen=True)
class FieldLimits:
    """The most UTF-8 bytes each peer-supplied field of a request may hold; a request with a
    larger one ends its stream (`FieldTooLarge`). `error_detail` is the exception: a larger
    NACK text is kept truncated to it, never refused (Envoy's embed whole resources)."""

    node_id: int = 1024
    node_cluster: int = 1024
    node_locality: int = 256  # each of region, zone and sub_zone
    node_user_agent: int = 256  # each of user_agent_name and user_agent_version
    node_metadata: int = 64 * 1024  # serialised
    node: int = 256 * 1024  # the whole Node serialised (Envoy lists its extensions: ~50 KB)
    resource_name: int = 1024  # each subscribed, unsubscribed or initial_resource_versions name
    type_url: int = 256
    version_info: int = 1024  # also each initial_resource_versions version
    response_nonce: int = 256
    error_detail: int = 4096  # kept, truncated beyond

    def __post_init__(self) -> None:
        for limit in dataclass_fields(self):
            if getattr(self, limit.name) < 1:
                raise ValueError(f"{limit.name} must be >= 1, got {getattr(self, limit.name)}")
        if self.error_detail < 128:
            raise ValueError(f"error_detail must be >= 128, got {self.error_detail}")


@dataclass(frozen=True)
class StreamLimits:
    """What one stream may ask for and be sent (`xds.limits` in the config: the first two)."""

    max_resource_names: int = MAX_RESOURCE_NAMES
    max_response_bytes: int = MAX_RESPONSE_BYTES
    max_subscription_bytes: int = MAX_SUBSCRIPTION_BYTES
    max_types: int = MAX_TYPES
    fields: FieldLimits = field(default_factory=FieldLimits)

    def __post_init__(self) -> None:
        for name in ("max_resource_names", "max_subscription_bytes", "max_types"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_response_bytes <= RESPONSE_HEADROOM:
            raise ValueError(f"max_response_bytes must be above {RESPONSE_HEADROOM}, got "
                             f"{self.max_response_bytes}")

    @property
    def part_bytes(self) -> int:
        """The most resource (and removed-name) bytes one response may carry."""
        return self.max_response_bytes - RESPONSE_HEADROOM
