"""The reference controller of issue 11, the baseline that ``trimtab bench`` compares with:

    w = 100 * cap_norm * (1 - kv_use) / (1 + waiting)

every tick from the same ``/metrics`` pages (``cap_norm``: KV capacity over the pool's
largest). Pure: (inputs, policy, now, previous) -> weights, like every policy here.

Staleness, invalid inputs and fail-static are the composite policy's (its assessment is
reused, with the KV use and the queue as the load signals); there is no smoothing, no
deadband and no DEGRADED state: the formula's weight applies at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from weight_calculator.assessment import _capacity_scale, assess_pool, complete_pool
from weight_calculator.health import HEALTHY
from weight_calculator.inputs import MIN_WEIGHT, CompositePolicy, EndpointInput
from weight_calculator.types import EndpointWeight, PoolWeights


def reference_weight(kv_use: float, waiting: float, cap_norm: float, max_weight: int = 100
                     ) -> int:
    """``clamp(round(max_weight * cap_norm * (1 - kv_use) / (1 + waiting)), 1, max_weight)``."""
    raw = max_weight * cap_norm * (1.0 - kv_use) / (1.0 + waiting)
    return int(max(MIN_WEIGHT, min(max_weight, round(raw))))


def compute_reference_weights(inputs: Mapping[str, EndpointInput], policy: CompositePolicy,
                              now: float, previous: PoolWeights | None) -> PoolWeights:
    """The reference weights for one pool; ``policy`` supplies staleness, max_weight and
    stale_after_seconds only (its mixes, EWMA and deadband are not used)."""
    shared = CompositePolicy(memory_mix=1.0, queue_mix=1.0, latency_mix=0.0, queue_cap=1e18,
                             max_weight=policy.max_weight, kv_degraded=1.0,
                             staleness=policy.staleness,
                             stale_after_seconds=policy.stale_after_seconds)
    pool = assess_pool(inputs, shared, now, previous)
    if pool.fail_static is not None:
        return pool.fail_static
    top, typical = _capacity_scale(pool.assessed, shared)
    endpoints: dict[str, EndpointWeight] = {}
    for address, x in pool.usable.items():
        cap_norm = (x.capacity if x.capacity is not None else typical) / top
        kv, waiting = x.signals.get("kv_usage", 0.0), x.signals.get("queue", 0.0)
        weight = reference_weight(kv, waiting, cap_norm, shared.max_weight)
        breakdown = {**{f"input.{k}": v for k, v in x.signals.items()},
                     "relative_capacity": cap_norm, "weight": float(weight)}
        endpoints[address] = EndpointWeight(weight, x.last_failed, False, x.signals,
                                            x.updated_at, x.reason, HEALTHY, breakdown)
    return complete_pool(pool, endpoints, shared)
