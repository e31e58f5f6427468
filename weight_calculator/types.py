"""Value types shared by the telemetry layer and the pure weight functions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from weight_calculator.health import Health


@dataclass(frozen=True)
class Sample:
    """One successful telemetry read of one endpoint."""

    collected_at: float  # unix seconds when it was read
    signals: Mapping[str, float] = field(default_factory=dict)
    # Inputs present on the read but rejected (NaN, negative, out of range) or partly failed
    # (e.g. the node's DCGM page), one line each; they are never in ``signals``.
    problems: tuple[str, ...] = ()
    # Load signals the server reports but sent garbled for longer than stale_after: they
    # count as saturated (see :mod:`weight_calculator.loss`); a value held from an earlier
    # read is in ``signals`` and not named here.
    saturated: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observation:
    """What the telemetry layer knows about one endpoint right now."""

    sample: Sample | None  # last GOOD sample, or None if never read successfully
    error: str | None = None  # error of the LATEST attempt; None if it succeeded
    first_seen: float | None = None  # unix seconds the endpoint was first known (warm-up)
    # Read attempts that failed in a row since the last good sample (0: the latest worked).
    # Staleness is counted in these missed ticks (see :mod:`weight_calculator.loss`).
    failures: int = 0


@dataclass(frozen=True)
class GpuMemoryPolicy:
    """Knobs for the GPU-memory weighting policy."""

    stale_after_seconds: float = 6.0
    min_weight: int = 1
    max_weight: int = 100

    def __post_init__(self) -> None:
        if not (math.isfinite(self.stale_after_seconds) and self.stale_after_seconds >= 0):
            raise ValueError(
                f"stale_after_seconds must be finite and >= 0, got {self.stale_after_seconds!r}"
            )
        if self.min_weight < 1:
            raise ValueError(f"min_weight must be >= 1 (Envoy rejects 0), got {self.min_weight}")
        if self.max_weight < self.min_weight:
            raise ValueError(
                f"max_weight ({self.max_weight}) must be >= min_weight ({self.min_weight})"
            )


@dataclass(frozen=True)
class EndpointWeight:
    """The weight chosen for one endpoint, with the inputs and reason behind it."""

    weight: int  # always >= 1 (Envoy NACKs 0)
    stale: bool  # latest attempt failed, or no sample yet
    saturated: bool  # stale longer than stale_after (or never seen / unusable sample)
    signals: Mapping[str, float]  # the inputs used (copy of sample.signals, may be empty)
    updated_at: float | None  # collected_at of the sample used, None if none
    reason: str = ""  # short human reason, e.g. "ok", "no telemetry yet", "fail-static"
    # Added for the composite policy; defaults keep older producers/consumers working.
    health: str = Health.HEALTHY  # a weight_calculator.health.Health
    breakdown: Mapping[str, float] = field(default_factory=dict)  # inputs, normalised, shares
    problems: tuple[str, ...] = ()  # rejected or partly failed inputs (see Sample.problems)
    # The Envoy locality (capacity tier) the endpoint is published in; None: the pool has one
    # locality for every endpoint (weight_calculator.capacity_tiers).
    locality: str | None = None


@dataclass(frozen=True)
class PoolWeights:
    """Weights for every endpoint of one pool."""

    endpoints: Mapping[str, EndpointWeight]  # keyed by endpoint address "host:port"
    fail_static: bool  # every endpoint stale beyond the limit -> held previous weights
    # Missed ticks of each endpoint that fell in a pool-wide loss: once the pool reads again
    # they do not count against stale_after (see weight_calculator.loss), while that endpoint
    # is still catching up.
    excused: Mapping[str, int] = field(default_factory=dict)
    # Locality (capacity tier) -> its Envoy load_balancing_weight: the tier's share of the
    # pool; empty when the endpoints are not grouped (one locality of weight 1).
    localities: Mapping[str, int] = field(default_factory=dict)
