"""Composite weighting: KV/GPU memory, queue depth and inter-token latency, scaled by capacity.

Pure functions only: the caller passes ``now`` and the previous weights; nothing here reads
a clock or does I/O.

Per endpoint (all inputs optional)::

    memory  = kv_usage            (0..1)   else gpu_mem_pct / 100
    queue   = min(queue / queue_cap, 1)
    latency = min(itl_ms / itl_slo_ms, 2) / 2          # ITL at the SLO -> 0.5
    load    = sum(mix_i * norm_i) / sum(mix_i)         # over the signals present
    score   = (1 - load) * capacity / max_capacity_in_pool
    target  = clamp(round(score * max_weight), 1, max_weight)

``running`` is validated and reported but is not part of the load mix (queue depth is the
backlog signal; running requests are already reflected in KV use and latency).

Then, against the previous weight of the same endpoint: a deadband (``|target - previous|
< min(deadband, 0.1 * previous)`` keeps the previous weight) and an EWMA (``alpha * target + (1 - alpha) *
previous``, rounded). Hard limits (``kv_usage >= kv_degraded`` or ``queue >= queue_cap``)
mark the endpoint DEGRADED and give weight 1 at once, bypassing deadband and EWMA.

Capacity comes from the endpoint's ``Signals.capacity`` (KV-cache tokens), else its
``configured_capacity`` (must be in the same unit, KV tokens); an endpoint with neither is
given the median known capacity of the pool, and when no endpoint knows its capacity all
count as equal. The pool maximum is taken over every endpoint whose capacity is known,
fresh or stale (so a big GPU going stale does not inflate the others), except under
``staleness="ignore"``, which drops stale endpoints from the computation entirely.

Staleness (no sample, sample older than ``stale_after_seconds``) and invalid inputs (NaN,
infinite, negative, out of range, no load signal at all) are handled alike, per
``CompositePolicy.staleness``:

* ``"saturated"`` (default): weight 1 - the endpoint keeps a trickle of traffic.
* ``"hold"``: keep the previous weight (1 when there is none) for as long as it is stale.
* ``"ignore"``: drop it from the capacity normalisation and give it the *neutral* weight,
  the (lower) median of the weights computed for the usable endpoints this tick - i.e.
  "no information" routes like an average member, not like a saturated one.

If every endpoint of a non-empty pool is stale or invalid, the pool is fail-static: every
previous weight is held (1 where unknown) and ``PoolWeights.fail_static`` is true.
"""

from __future__ import annotations

from collections.abc import Mapping

from weight_calculator.assessment import (
    _Assessed,
    _capacity_scale,
    _Plan,
    _Term,
    assess_pool,
    complete_pool,
)
from weight_calculator.health import DEGRADED, HEALTHY
from weight_calculator.inputs import _INPUT_KEYS, MIN_WEIGHT, CompositePolicy, EndpointInput, _clamp
from weight_calculator.types import EndpointWeight, PoolWeights

# --- load and weight of a usable endpoint -----------------------------------------------------


def _normalised(signals: Mapping[str, float], policy: CompositePolicy) -> dict[str, float]:
    """Each load key present, in ``[0, 1]`` (``min(x, cap)`` is written ``cap if x > cap``)."""
    norms: dict[str, float] = {}
    kv, gpu = signals.get("kv_usage"), signals.get("gpu_mem_pct")
    if kv is not None:
        norms["memory"] = kv
    elif gpu is not None:
        norms["memory"] = gpu / 100.0
    queue, itl = signals.get("queue"), signals.get("itl_ms")
    if queue is not None:
        queue /= policy.queue_cap
        norms["queue"] = 1.0 if queue > 1.0 else queue
    if itl is not None:
        itl /= policy.itl_slo_ms
        norms["latency"] = (2.0 if itl > 2.0 else itl) / 2.0
    return norms


def _degraded(signals: Mapping[str, float], policy: CompositePolicy) -> str | None:
    kv, queue = signals.get("kv_usage"), signals.get("queue")
    if kv is not None and kv >= policy.kv_degraded:
        return f"degraded: kv_usage {kv:g} >= {policy.kv_degraded:g}"
    if queue is not None and queue >= policy.queue_cap:
        return f"degraded: queue {queue:g} >= queue_cap {policy.queue_cap:g}"
    return None


def _target(
    norms: Mapping[str, float],
    relative: float,
    terms: tuple[_Term, ...],
    policy: CompositePolicy,
    breakdown: dict[str, float],
) -> int:
    """The un-smoothed weight; adds its breakdown (shares sum to the score) to ``breakdown``."""
    load = 0.0
    for key, share, norm_key, mix_key, share_key in terms:
        norm = norms[key]
        breakdown[norm_key] = norm
        breakdown[mix_key] = share
        breakdown[share_key] = share * (1.0 - norm) * relative
        load += share * norm
    headroom = 1.0 - load
    score = headroom * relative
    breakdown["headroom"] = headroom
    breakdown["relative_capacity"] = relative
    breakdown["score"] = score
    return _clamp(round(score * policy.max_weight), policy)


RELATIVE_DEADBAND = 0.10  # the band never exceeds this share of the previous weight


def _smooth(target: int, previous: int | None, policy: CompositePolicy) -> int:
    """Deadband on the target, then EWMA towards it. The band is ``deadband`` weight units,
    but at most :data:`RELATIVE_DEADBAND` of the previous weight: a small endpoint's weight
    (an L4 at 6) can still move by one (issue 11)."""
    if previous is None:
        return target
    if abs(target - previous) < min(policy.deadband, RELATIVE_DEADBAND * previous):
        return _clamp(previous, policy)
    blended = policy.ewma_alpha * target + (1.0 - policy.ewma_alpha) * previous
    return _clamp(round(blended), policy)


def _usable_weight(
    a: _Assessed,
    relative: float,
    previous: EndpointWeight | None,
    policy: CompositePolicy,
    plan: _Plan,
) -> EndpointWeight:
    signals = a.signals
    norms = _normalised(signals, policy)
    degraded = _degraded(signals, policy)
    breakdown = {_INPUT_KEYS[name]: value for name, value in signals.items()}  # clean floats
    if degraded is not None:
        weight, health, reason = MIN_WEIGHT, DEGRADED, degraded
        breakdown.update({f"norm.{k}": v for k, v in norms.items()})
        breakdown["target_weight"] = float(MIN_WEIGHT)
    else:
        target = _target(norms, relative, plan.terms[tuple(norms)], policy, breakdown)
        breakdown["target_weight"] = float(target)
        prior = previous.weight if previous is not None else None
        weight, health, reason = _smooth(target, prior, policy), HEALTHY, a.reason
    breakdown["weight"] = float(weight)
    return EndpointWeight(
        weight, a.last_failed, False, signals, a.updated_at, reason, health, breakdown
    )


def compute_composite_weights(
    inputs: Mapping[str, EndpointInput],
    policy: CompositePolicy,
    now: float,
    previous: PoolWeights | None,
) -> PoolWeights:
    """Weights for one pool (keyed like ``inputs``, by endpoint address). Never raises.

    ``previous`` is the result of the last call for this pool (or ``None``): it feeds the
    EWMA, the deadband, ``staleness="hold"`` and fail-static. An empty pool yields no
    endpoints and ``fail_static=False``.
    """
    pool = assess_pool(inputs, policy, now, previous)
    if pool.fail_static is not None:
        return pool.fail_static
    assessed, held, usable, plan = pool.assessed, pool.held, pool.usable, pool.plan
    top, typical = _capacity_scale(assessed, policy)
    endpoints = {
        address: _usable_weight(
            a,
            (a.capacity if a.capacity is not None else typical) / top,
            held.get(address),
            policy,
            plan,
        )
        for address, a in usable.items()
    }
    return complete_pool(pool, endpoints, policy)
