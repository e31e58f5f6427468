"""GPU-memory weighting: less framebuffer in use -> more traffic.

Pure functions only: the caller passes ``now``; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from weight_calculator.types import (
    EndpointWeight,
    GpuMemoryPolicy,
    Observation,
    PoolWeights,
)

SIGNAL = "gpu_mem_pct"
WEIGHT_FLOOR = 1
WEIGHT_CEILING = 100


def gpu_memory_weight(gpu_mem_pct: float) -> int:
    """Map GPU memory use (percent, 0..100) to a weight: ``clamp(round(100 - pct/2), 1, 100)``.

    Uses Python's ``round`` (half to even). Raises ``ValueError`` for NaN, infinities and
    values outside [0, 100], and for values that are not real numbers.
    """
    if isinstance(gpu_mem_pct, bool) or not isinstance(gpu_mem_pct, numbers.Real):
        raise ValueError(f"gpu_mem_pct must be a real number, got {gpu_mem_pct!r}")
    pct = float(gpu_mem_pct)
    if not math.isfinite(pct):
        raise ValueError(f"gpu_mem_pct must be finite, got {pct!r}")
    if pct < 0.0 or pct > 100.0:
        raise ValueError(f"gpu_mem_pct must be within [0, 100], got {pct!r}")
    return max(WEIGHT_FLOOR, min(WEIGHT_CEILING, round(100.0 - pct / 2.0)))


def _clamp(weight: int, policy: GpuMemoryPolicy) -> int:
    return max(WEIGHT_FLOOR, policy.min_weight, min(policy.max_weight, weight))


def _saturated(policy: GpuMemoryPolicy, obs: Observation, reason: str) -> EndpointWeight:
    sample = obs.sample
    return EndpointWeight(
        weight=_clamp(policy.min_weight, policy),
        stale=True,
        saturated=True,
        signals=dict(sample.signals) if sample is not None else {},
        updated_at=sample.collected_at if sample is not None else None,
        reason=reason,
    )


def _endpoint_weight(obs: Observation, policy: GpuMemoryPolicy, now: float) -> EndpointWeight:
    """Weight for one endpoint, ignoring the pool-wide fail-static rule."""
    sample = obs.sample
    if sample is None:
        suffix = f" ({obs.error})" if obs.error else ""
        return _saturated(policy, obs, f"no telemetry yet{suffix}")
    age = now - sample.collected_at
    if not age <= policy.stale_after_seconds:  # also catches NaN ages
        return _saturated(
            policy, obs, f"stale {age:.1f}s > {policy.stale_after_seconds:g}s: saturated"
        )
    if SIGNAL in sample.saturated:
        return _saturated(policy, obs, f"{SIGNAL} rejected for longer than "
                                       f"{policy.stale_after_seconds:g}s: saturated")
    try:
        weight = gpu_memory_weight(sample.signals[SIGNAL])
    except KeyError:
        return _saturated(policy, obs, f"sample has no {SIGNAL}: saturated")
    except ValueError as exc:
        return _saturated(policy, obs, f"invalid {SIGNAL}: {exc}: saturated")
    stale = obs.error is not None
    return EndpointWeight(
        weight=_clamp(weight, policy),
        stale=stale,
        saturated=False,
        signals=dict(sample.signals),
        updated_at=sample.collected_at,
        reason=f"last scrape failed, using sample {age:.1f}s old" if stale else "ok",
    )


def _fail_static(
    fresh: Mapping[str, EndpointWeight],
    policy: GpuMemoryPolicy,
    previous: PoolWeights | None,
) -> PoolWeights:
    """Hold previous weights (min_weight where unknown) when all telemetry is lost."""
    held = previous.endpoints if previous is not None else {}
    endpoints: dict[str, EndpointWeight] = {}
    for address, computed in fresh.items():
        prior = held.get(address)
        weight = prior.weight if prior is not None else policy.min_weight
        endpoints[address] = EndpointWeight(
            weight=_clamp(weight, policy),
            stale=True,
            saturated=True,
            signals=computed.signals,
            updated_at=computed.updated_at,
            reason="fail-static",
        )
    return PoolWeights(endpoints=endpoints, fail_static=True)


def compute_pool_weights(
    observations: Mapping[str, Observation],
    policy: GpuMemoryPolicy,
    now: float,
    previous: PoolWeights | None,
) -> PoolWeights:
    """Compute weights for one pool from the latest observations.

    Fresh samples are weighted by :func:`gpu_memory_weight`; endpoints whose telemetry is
    older than ``policy.stale_after_seconds`` (or absent, or unusable) get ``min_weight``.
    If every endpoint is in that state the pool goes fail-static: previous weights are held
    (not when none was ever read: there is nothing to hold, and warm-up applies).
    An empty pool yields no endpoints and ``fail_static=False``. Never raises.
    """
    fresh = {
        address: _endpoint_weight(observations[address], policy, now)
        for address in sorted(observations)
    }
    ever_read = (any(obs.sample is not None for obs in observations.values())
                 or previous is not None
                 and any(ew.updated_at is not None for ew in previous.endpoints.values()))
    if fresh and all(ew.saturated for ew in fresh.values()) and ever_read:
        # fail-static holds weights from before a loss; a pool never read lost nothing
        return _fail_static(fresh, policy, previous)
    return PoolWeights(endpoints=fresh, fail_static=False)
