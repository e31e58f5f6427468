"""Limits on the xDS port: a token bucket per peer (`RateLimiter`) and the gRPC server options
that bound streams, request size and connection age (`server_options`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RateLimiter:
    """Token bucket per peer: `burst` requests at once, refilled at `rate_per_s`. Pure: the
    caller passes the time. Idle peers are forgotten once more than `max_peers` are known."""

    rate_per_s: float
    burst: float
    max_peers: int = 10_000
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {self.rate_per_s}, "
                             f"{self.burst}")

    def allow(self, peer: str, now: float) -> bool:
        tokens, last = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate_per_s)
        allowed = tokens >= 1
        self._buckets[peer] = (tokens - 1 if allowed else tokens, now)
        if len(self._buckets) > self.max_peers:
            self._forget_idle(now)
        return allowed

    def _forget_idle(self, now: float) -> None:
        """Drop peers whose bucket has refilled: forgetting them changes nothing."""
        self._buckets = {peer: (tokens, last) for peer, (tokens, last) in self._buckets.items()
                         if tokens + max(0.0, now - last) * self.rate_per_s < self.burst}

    def __len__(self) -> int:
        return len(self._buckets)


def server_options(max_concurrent_streams: int | None = 16,
                   max_receive_bytes: int | None = 16 * 1024 * 1024,
                   max_connection_age_s: float | None = None,
                   max_connection_age_grace_s: float | None = 30.0) -> list[tuple[str, int]]:
    """grpc server options for the xDS port.

    * ``grpc.max_concurrent_streams``: HTTP/2 streams per *connection* (an ADS Envoy uses 1,
      per-type xDS 4). Server-wide, pass ``maximum_concurrent_rpcs`` to ``grpc.aio.server``.
    * ``grpc.max_receive_message_length``: the largest request; larger ones fail with
      RESOURCE_EXHAUSTED. A NACK carries Envoy's error text, which may embed a resource.
    * ``grpc.max_connection_age_ms`` (+/-10 % jitter by gRPC) sends GOAWAY after that age;
      ``grpc.max_connection_age_grace_ms`` then closes the connection, ending the xDS
      stream: Envoy reconnects, through the load balancer, possibly to another replica. xDS
      streams never end on their own, so an age without a grace does nothing for them."""
    options: list[tuple[str, int]] = []
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", _positive(max_concurrent_streams,
                                                                 "max_concurrent_streams")))
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length",
                        _positive(max_receive_bytes, "max_receive_bytes")))
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms",
                        _positive(round(max_connection_age_s * 1000), "max_connection_age_s")))
        if max_connection_age_grace_s is not None:
            grace = round(max_connection_age_grace_s * 1000)
            if grace < 0:
                raise ValueError(f"max_connection_age_grace_s must be >= 0, got "
                                 f"{max_connection_age_grace_s}")
            options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def _positive(value: int, name: str) -> int:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)
