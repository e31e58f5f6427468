"""Queueing weights: each endpoint's service rate, learnt from its own counters, and the
traffic share that keeps the pool's waits short.

Pure functions only: the caller passes the counter history (``readings``), ``now`` and the
previous weights; nothing here reads a clock or does I/O. The memory, each endpoint's
service-rate estimate and each locality's weight, travels in the previous weights
(``breakdown["service_rate"]``, ``localities``), so the result depends on nothing but the
arguments.

**Capacity tiers** (``capacity_tiers``, the default; :mod:`weight_calculator.capacity_tiers`,
:mod:`weight_calculator.localities`): endpoints of one KV capacity are the same hardware. They
share one service rate, measured over all of them, and Envoy gets them as one locality whose
weight is the tier's share, every member at the same host weight, so Envoy's least_request
picks among twins by their requests in flight. Without tiers (``capacity_tiers: false``, or
a hash balancer) each endpoint has its own rate and weight, as in round 2 (below).

Per endpoint, over the readings of the last ``window_seconds``:

* **Work** is prompt plus generation tokens (``vllm:prompt_tokens_total`` +
  ``vllm:generation_tokens_total``), the throughput ``X`` their delta over time.
* **Service rate** ``mu``: the throughput *at the utilisation seen*. An interval between two
  reads that found the engine full at its start (requests waiting, or the KV cache at
  ``kv_degraded`` or more: no room for another) and still busy at its end measured its
  capacity: ``mu = sum(work) / sum(dt)`` over those intervals (``utilisation: queued``, the
  default; ``saturated``, round 2's, wanted it full at both ends, which left out the
  intervals where long prefills completed and measured 15-40 % low:
  :func:`weight_calculator.service_rate._utilisation`). Any other interval only bounds
  ``mu`` from below (it did at least ``X``). With tiers the intervals of every member of a
  tier are pooled. There is a measurement only once the window holds one horizon (``H``)
  of queued time.
  ``utilisation: kv`` also counts unqueued intervals, scaled up by their mean KV use
  (``sum(work) / sum(dt * u)``, intervals below ``min_utilisation`` skipped); measured on
  the simulator it overestimates fast GPUs about twofold (throughput does not grow linearly
  to a full KV cache), so it is not the default. The estimate is smoothed with
  ``rate_alpha`` against the previous one and never below the window's throughput. Before
  an endpoint has been measured the pool's prior applies: its KV capacity times the median
  rate per KV token of the measured endpoints (or, when none is, its KV capacity alone: the
  weights are then proportional to capacity, over ``1 + waiting``), at least its throughput.
  Over-estimating an unmeasured endpoint corrects itself (it queues, and is measured);
  under-estimating would not, which is why the prior is taken from measurements at capacity,
  and why a tier with no fresh measurement drifts up toward that prior (``H / window`` of
  the gap each tick): a low estimate from a few early intervals would otherwise keep a tier
  on standby, unmeasured, for good.
* **Backlog** ``q = (waiting + in_flight_share * running) * c``, with ``c`` the pool's mean
  work per finished request over the window: the queued and in-flight work ahead of a new
  request (a running request is half done on average, ``in_flight_share`` 0.5). The
  **predicted wait** ``W = q / mu`` is the time the endpoint needs to clear it; it is
  reported in the breakdown. Counting in-flight work stops an open-loop balancer (round
  robin) from piling requests onto one endpoint until its KV cache is full: measured, one
  H100 reached 217 running requests at 99.5 % KV while its twin had 122, when only waiting
  requests counted.

The pool's arrival rate ``lam`` is the sum of the throughputs. The traffic share
(:mod:`weight_calculator.splits`) is by default the **equal-spare** split: every endpoint in
use keeps the same spare rate, ``r_i = mu_i - (M - lam) / n`` with ``M`` the sum of the
``n`` used endpoints' rates, an endpoint slower than that spare left out and the rest
recomputed. An M/M/1 queue's response time has the tail ``exp(-(mu - r) t)``, so the pool's
P99 is set by the smallest spare ``mu_i - r_i``; this split maximises it (measured on the
heterogeneous fleet it gave the A100s about 18 % of the requests where the square-root rule
gave 23 %, and a lower P99 and P50: docs/results/weights.md, round 2). ``split:
square_root`` (round 1's default) minimises the mean sojourn time instead, ``r_i = mu_i -
sqrt(mu_i) * (M - lam) / sum(sqrt(mu_j))``. When the pool is overloaded (``lam >= M``) the
share is proportional to ``mu``. Then the predicted wait discounts it, in units of the
horizon over which the weight will hold (``H = horizon_seconds``, the telemetry interval):
``r_i = r_i / (1 + W_i / H)`` with ``W_i = q_i / mu_i``. A queue that a big GPU clears in a
fraction of a tick costs it little; a small GPU whose queue means ten seconds loses nearly
all of its share at once.

**Envoy's divisor** (without tiers). Envoy's weighted least_request picks a host in proportion to ``weight /
(active + 1) ** bias``; a host with many requests in flight (a fast GPU at the share it
should have) is thereby picked less than its weight says, and the split Envoy serves drifts
toward equal in-flight counts (round 1: the A100s and L4s got a quarter of the requests
whatever their weights). The weights therefore carry the divisor: ``target = max_weight *
s_i / max s`` with ``s_i = r_i * (a_i + 1) ** active_request_bias`` (``active_request_bias``
0, no factor, for round robin; the caller passes the pool's), clamped to ``[1,
max_weight]``. ``a_i`` is the count the endpoint would hold *at its share*: by Little's law
the count seen (running + waiting) times ``min(1, r_i / X_i)``. Multiplying by the count
seen instead cancelled Envoy's balancing: measured, one H100 held 95-133 requests (predicted
wait 8-10 s) at weight 100 while its twin held 20-30 at 9-53, and the two swapped
(docs/results/weights.md, round 2). Between ticks Envoy still divides by the host's current
count, so a host whose count grows past the tick's is picked less at once.

An endpoint the split leaves out (``r_i = 0``: the others serve this load with a larger spare)
or whose share is below one weight unit (``max_weight * s_i / max s < 1``: the floor of 1
would give it more than its share) is put on **standby**: health ``STANDBY``, sent to Envoy
as priority 1 (failover: nothing while priority 0's healthy hosts cover it), so it gets no
new requests rather than the 1 % that the weight floor of 1 would still send it (on the
mixed workload that 1 % sent an L4 a 32k-token prompt every few minutes, and the chats
queued behind it were a third of the slowest 3 %). It is back in
service at the next tick the split includes it; never more than ``max_standby_share`` (half)
of a pool is on standby, the smallest shares first. With capacity tiers a tier is on standby
whole (:mod:`weight_calculator.localities`). ``standby: false`` keeps weight 1 instead.

**Sustained overload** (:mod:`weight_calculator.overload`): when the pool's backlog grows
past what it serves with every endpoint outside the slowest tier full, an endpoint sent
more than its rate admits the excess into its batch and finishes almost nothing, so the
split above (which runs every endpoint past its rate in proportion) is replaced: each tier
but the slowest gets its service rate in requests, the slowest tier the rest; no endpoint
is DEGRADED for a full KV cache or put on standby (the pool needs all of them). The
breakdown then carries ``pool_excess_share``, the share of arrivals the pool did not serve,
and the next tick stays in this mode while the backlog keeps growing.

Smoothing is relative to the weight: a target within ``deadband`` (a fraction, 0.1 = 10 %)
of the previous weight keeps it, so noise does not rebuild Envoy's balancer; a larger drop
applies at once (an overloaded endpoint loses its traffic within one tick); a rise moves
``rise_alpha`` of the way (a recovered endpoint is trusted gradually).

Staleness, invalid inputs, fail-static and DEGRADED at ``kv_degraded`` (not when every usable
endpoint of the pool is that full: that is load, not a fault) behave exactly as in
the composite policy (:mod:`weight_calculator.composite`, whose assessment this module
reuses); readings need not be present (a server without the counters is weighted by its
capacity prior and its queue).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from weight_calculator.assessment import _Assessed, assess_pool, complete_pool
from weight_calculator.capacity_tiers import capacity_tiers
from weight_calculator.health import DEGRADED, HEALTHY, STANDBY
from weight_calculator.inputs import (
    MIN_WEIGHT,
    STALENESS_MODES,
    CompositePolicy,
    EndpointInput,
    Staleness,
)
from weight_calculator.localities import OVERPROVISIONING, plan_localities
from weight_calculator.overload import overload_split, pool_excess, slowest_tier
from weight_calculator.service_rate import Rates, Reading, rates
from weight_calculator.splits import SPLITS, equal_spare_split, square_root_split
from weight_calculator.types import EndpointWeight, PoolWeights

__all__ = ["SPLITS", "QueueingPolicy", "Reading", "compute_queueing_weights",
           "equal_spare_split", "rates", "square_root_split"]


@dataclass(frozen=True)
class QueueingPolicy:
    """Knobs of the queueing policy (see the module docstring)."""

    max_weight: int = 100
    horizon_seconds: float = 2.0  # backlog drained over this; the caller passes the tick
    window_seconds: float = 20.0  # readings used for the rates
    rate_alpha: float = 0.5  # EWMA of the service-rate estimate
    min_utilisation: float = 0.05  # intervals less busy than this say nothing about mu
    deadband: float = 0.10  # relative: |target - previous| <= deadband * previous keeps it
    rise_alpha: float = 0.5  # a rise moves this share of the way; a drop applies at once
    kv_degraded: float = 0.95
    staleness: Staleness = "saturated"
    stale_after_seconds: float = 6.0
    split: str = "equal_spare"  # or "square_root", "proportional" (docs/results/weights.md)
    utilisation: str = "queued"  # or "saturated" (round 2), "kv" (service_rate._utilisation)
    work: str = "tokens"  # prompt + generation tokens, or "prompt" (prefill alone)
    in_flight_share: float = 0.5  # a running request's remaining work, in mean requests
    standby: bool = True  # endpoints the split leaves out get no new requests (EDS priority 1)
    # At most this share of a pool on standby, else none is: 0.5 keeps it above Envoy's panic
    # threshold; a pool with a fallback needs STANDBY_WITH_FALLBACK (see there).
    max_standby_share: float = 0.5
    # Envoy's least_request divides each weight by (active + 1) ** bias; the weights are
    # multiplied by (in flight + 1) ** bias so that its picks follow the shares (0: round
    # robin, which follows the weights as they are). The caller passes the pool's LB.
    active_request_bias: float = 0.0
    # one Envoy locality per capacity tier (weight_calculator.localities); False: one locality
    # and per-endpoint weights (round 2, and for hash balancers, which ignore localities)
    capacity_tiers: bool = True
    # equal host weights inside a tier even with active_request_bias 0 (a least_request
    # pool configured without the divisor); under round robin leave it False
    equal_hosts: bool = False

    def __post_init__(self) -> None:
        checks = {
            "split": self.split == "proportional" or self.split in SPLITS,
            "utilisation": self.utilisation in ("queued", "saturated", "kv"),
            "work": self.work in ("tokens", "prompt"),
            "in_flight_share": 0 <= self.in_flight_share <= 1,
            "max_standby_share": 0 <= self.max_standby_share <= 0.5,
            "active_request_bias": 0 <= self.active_request_bias <= 100,
            "max_weight": self.max_weight >= MIN_WEIGHT,
            "horizon_seconds": 0 < self.horizon_seconds < math.inf,
            "window_seconds": 0 < self.window_seconds < math.inf,
            "rate_alpha": 0 < self.rate_alpha <= 1,
            "min_utilisation": 0 < self.min_utilisation <= 1,
            "deadband": 0 <= self.deadband < 1,
            "rise_alpha": 0 < self.rise_alpha <= 1,
            "kv_degraded": 0 < self.kv_degraded <= 1,
            "staleness": self.staleness in STALENESS_MODES,
            "stale_after_seconds": 0 <= self.stale_after_seconds < math.inf,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"QueueingPolicy.{bad[0]} out of range: {getattr(self, bad[0])!r}")

    def shared(self) -> CompositePolicy:
        """The composite policy whose assessment (staleness, validation, fail-static) and
        DEGRADED rule this policy shares."""
        return CompositePolicy(memory_mix=1.0, queue_mix=1.0, latency_mix=0.0,
                               queue_cap=1e18, max_weight=self.max_weight,
                               kv_degraded=self.kv_degraded, staleness=self.staleness,
                               stale_after_seconds=self.stale_after_seconds)


# --- weights ----------------------------------------------------------------------------------


def _clamp(weight: float, policy: QueueingPolicy) -> int:
    return int(max(MIN_WEIGHT, min(policy.max_weight, weight)))


def smooth(target: int, previous: int | None, policy: QueueingPolicy) -> int:
    """Relative deadband, drops at once, rises by ``rise_alpha``."""
    if previous is None:
        return _clamp(target, policy)
    if abs(target - previous) <= policy.deadband * previous:
        return _clamp(previous, policy)
    if target < previous:
        return _clamp(target, policy)
    return _clamp(round(previous + policy.rise_alpha * (target - previous)), policy)


@dataclass(slots=True)
class _Estimate:
    address: str
    assessed: _Assessed
    rates: Rates
    service_rate: float | None  # smoothed, None until evidence (its tier's when tiered)
    capacity: float | None


def _prior_rate(previous: EndpointWeight | None) -> float | None:
    """The service-rate estimate carried in the previous weight's breakdown, if sound."""
    prior = previous.breakdown.get("service_rate") if previous is not None else None
    return prior if prior is not None and math.isfinite(prior) and prior > 0 else None


def _smoothed(fresh: float | None, prior: float | None, policy: QueueingPolicy
              ) -> float | None:
    if fresh is None:
        return prior
    if prior is None:
        return fresh
    return policy.rate_alpha * fresh + (1.0 - policy.rate_alpha) * prior


def _service_rate(r: Rates, previous: EndpointWeight | None, policy: QueueingPolicy
                  ) -> float | None:
    estimate = _smoothed(r.service_rate, _prior_rate(previous), policy)
    if estimate is not None and r.throughput is not None and r.throughput > estimate:
        estimate = r.throughput  # it did this much: its rate is at least that
    return estimate


def _rates_per_kv(estimates: Sequence[_Estimate]) -> float | None:
    per_kv = [e.service_rate / e.capacity for e in estimates
              if e.service_rate is not None and e.capacity]
    return statistics.median(per_kv) if per_kv else None


def _filled(estimates: Sequence[_Estimate]) -> dict[str, float]:
    """Every usable endpoint's service rate: its own, else the prior (module docstring)."""
    known_caps = [e.capacity for e in estimates if e.capacity]
    typical = statistics.median(known_caps) if known_caps else 1.0
    per_kv = _rates_per_kv(estimates)
    out = {}
    for e in estimates:
        capacity = e.capacity or typical
        if e.service_rate is not None:
            out[e.address] = e.service_rate
        elif per_kv is not None:
            out[e.address] = max(per_kv * capacity, e.rates.throughput or 0.0)
        else:
            out[e.address] = capacity  # no rate anywhere yet: relative capacity
    return out


def _work_per_request(estimates: Sequence[_Estimate]) -> float | None:
    work = sum(e.rates.work for e in estimates)
    done = sum(e.rates.done for e in estimates)
    return work / done if done > 0 and work > 0 else None


# A pool with a fallback is an aggregate cluster's first priorities: Envoy spills to the
# fallback only when the pool's priorities are short of healthy hosts. Standby hosts sit in
# the pool's priority 1 and are healthy, so nothing spills; the tighter budget (from when
# standby was DRAINING in priority 0) is kept as the conservative limit for such pools.
STANDBY_WITH_FALLBACK = 1.0 - 1.0 / OVERPROVISIONING
# STANDBY (weight_calculator.health): the split gives it no share at this load: EDS priority 1


def _endpoint(e: _Estimate, mu: float, share: float, units: float, backlog: float,
              previous: EndpointWeight | None, policy: QueueingPolicy, standby: bool,
              degraded: bool, share_units: float, rated: bool = True,
              per_request: float | None = None) -> EndpointWeight:
    """``units``: the weight the share asks for, ``max_weight`` for the busiest endpoint;
    ``share_units`` the same without Envoy's divisor (``share_weight`` in the breakdown, for
    clusters whose active counts are not the pool's: the derived prompt-size classes)."""
    a = e.assessed
    signals = a.signals
    waiting = signals.get("queue", 0.0)
    breakdown = {f"input.{k}": v for k, v in signals.items()}
    breakdown.update({"throughput": e.rates.throughput or 0.0,
                      "saturated_seconds": e.rates.saturated_seconds,
                      "backlog": backlog, "predicted_wait_s": backlog / mu if mu > 0 else 0.0,
                      "target_rate": share})
    if e.service_rate is not None:
        breakdown["service_rate"] = mu
    if rated:  # measured, else the prior; not before any rate is (mu is a capacity then)
        breakdown["service_rate_used"] = mu  # the prompt classes' prefill cap reads it
    if per_request is not None:  # the admission budget reads it (admission.py)
        breakdown["work_per_request"] = per_request
    kv = signals.get("kv_usage")
    if degraded:
        weight, health, reason = MIN_WEIGHT, DEGRADED, (
            f"degraded: kv_usage {kv:g} >= {policy.kv_degraded:g}")
        breakdown["target_weight"] = float(MIN_WEIGHT)
    elif standby:
        weight, health = MIN_WEIGHT, STANDBY
        reason = (f"{a.reason}; standby: its share of the load is below one weight unit "
                  f"(its rate {mu:.0f} tokens/s)")
        breakdown["target_weight"] = float(MIN_WEIGHT)
    else:
        target = _clamp(round(units), policy)
        breakdown["target_weight"] = float(target)
        prior = previous.weight if previous is not None else None
        weight, health, reason = smooth(target, prior, policy), HEALTHY, a.reason
        if waiting:
            reason = f"{reason}; {waiting:g} waiting, predicted wait {breakdown['predicted_wait_s']:.1f}s"
    breakdown["weight"] = float(weight)
    breakdown["share_weight"] = float(MIN_WEIGHT if health != HEALTHY
                                      else _clamp(round(share_units), policy))
    return EndpointWeight(weight, a.last_failed, False, signals, a.updated_at, reason, health,
                          breakdown)


def _in_flight_at_share(e: _Estimate, share: float, rated: bool) -> float:
    """The requests the endpoint would hold in flight at its share: by Little's law the
    count seen (running + waiting) scaled by share / throughput, never above the count
    seen. An endpoint past its share (a queue building) so gets a smaller factor than its
    count, and Envoy, dividing by the count it sees, sends it less; at its share the two
    agree. Unscaled before any rate is measured (the shares are not in tokens/s then)."""
    signals = e.assessed.signals
    seen = signals.get("queue", 0.0) + signals.get("running", 0.0)
    done = e.rates.throughput
    if not rated or done is None or done <= 0:
        return seen
    return seen * min(1.0, share / done)


def _standby(units: Mapping[str, float], left_out: set[str], policy: QueueingPolicy
             ) -> set[str]:
    """Endpoints that get no new requests: those the split left out and those whose share
    is below one weight unit (the floor of 1 would give them more than their share), the
    smallest first, at most ``max_standby_share`` of the pool."""
    if not policy.standby:
        return set()
    candidates = sorted((a for a, u in units.items() if a in left_out or u < MIN_WEIGHT),
                        key=lambda a: (units[a], a))
    return set(candidates[:int(policy.max_standby_share * len(units) + 1e-9)])


def _units(values: Mapping[str, float], policy: QueueingPolicy) -> dict[str, float]:
    top = max(values.values(), default=0.0)
    return {a: policy.max_weight * v / top if top > 0 else float(policy.max_weight)
            for a, v in values.items()}


def _tier_rates(estimates: Sequence[_Estimate], tiers: Mapping[str, str],
                held: Mapping[str, EndpointWeight], policy: QueueingPolicy) -> None:
    """One service rate per capacity tier, pooled over its usable members: the work done in
    their measuring intervals over those intervals' time (identical servers, so a member
    that saw no queue is measured by its twins), smoothed with the members' previous
    estimates, never below the busiest member's throughput.

    A tier that measured nothing in the window (on standby, or never queued) drifts up
    toward its capacity prior (its KV capacity x the median rate per KV token of the tiers
    that did) by ``horizon / window`` of the gap each tick: an estimate that came out low
    from a few early intervals would otherwise keep the tier out of the split for good,
    since a tier without traffic is never measured again. It never drifts down: an
    over-estimate corrects itself (the tier queues and is measured)."""
    by_tier: dict[str, list[_Estimate]] = {}
    for e in estimates:
        by_tier.setdefault(tiers[e.address], []).append(e)
    fresh: dict[str, float] = {}
    for tier, group in by_tier.items():
        busy = sum(e.rates.busy_seconds for e in group)
        work = sum(e.rates.busy_work for e in group)
        if busy >= policy.horizon_seconds and work > 0:
            fresh[tier] = work / busy
    per_kv = [fresh[t] / cap for t in fresh
              if (cap := by_tier[t][0].capacity)]
    relax = min(1.0, policy.horizon_seconds / policy.window_seconds)
    for tier, group in by_tier.items():
        priors = [p for e in group if (p := _prior_rate(held.get(e.address))) is not None]
        estimate = _smoothed(fresh.get(tier), statistics.fmean(priors) if priors else None,
                             policy)
        capacity = group[0].capacity
        if tier not in fresh and estimate is not None and per_kv and capacity:
            target = statistics.median(per_kv) * capacity
            if target > estimate:
                estimate += relax * (target - estimate)
        floor = max((e.rates.throughput or 0.0) for e in group)
        if estimate is not None and floor > estimate:
            estimate = floor
        for e in group:
            e.service_rate = estimate


def _shares(estimates: Sequence[_Estimate], mu: Mapping[str, float],
            split: Mapping[str, float], rated: bool, policy: QueueingPolicy
            ) -> tuple[dict[str, float], dict[str, float]]:
    """Each endpoint's share of the load after its predicted-wait discount, and its backlog."""
    per_request = _work_per_request(estimates)
    shares: dict[str, float] = {}
    backlogs: dict[str, float] = {}
    for e in estimates:
        waiting = e.assessed.signals.get("queue", 0.0)
        running = e.assessed.signals.get("running", 0.0)
        if rated and per_request is not None:
            # queued requests whole, running ones half done on average
            backlogs[e.address] = (waiting + policy.in_flight_share * running) * per_request
            wait = backlogs[e.address] / mu[e.address] if mu[e.address] > 0 else math.inf
            shares[e.address] = split[e.address] / (1.0 + wait / policy.horizon_seconds)
        else:  # no work counters: the queue alone, as 1 / (1 + waiting)
            backlogs[e.address] = waiting * mu[e.address] * policy.horizon_seconds
            shares[e.address] = split[e.address] / (1.0 + waiting)
    if max(shares.values(), default=0.0) <= 0:  # all backlogged beyond their share: the rates
        shares = dict(mu)
    return shares, backlogs


def _degraded(estimates: Sequence[_Estimate], policy: QueueingPolicy) -> set[str]:
    """KV at ``kv_degraded`` or more, unless every usable endpoint is (that is load)."""
    full = {e.address for e in estimates
            if (e.assessed.signals.get("kv_usage") or 0.0) >= policy.kv_degraded}
    return set() if len(full) == len(estimates) else full


def _was_overloaded(previous: PoolWeights | None) -> bool:
    return previous is not None and any("pool_excess_share" in ew.breakdown
                                        for ew in previous.endpoints.values())


def _saturated_throughout(estimates: Sequence[_Estimate], span: float,
                          policy: QueueingPolicy) -> bool:
    """Reads over a whole window (one tick's slack), and every endpoint of ``estimates``
    (the pool's but the slowest tier's, which the split may have starved) full (requests
    waiting, or its KV cache) through all of it but one tick: the pool saturated, not
    filling from idle nor one endpoint's queue."""
    slack = policy.horizon_seconds
    return (span >= policy.window_seconds - slack
            and all(e.rates.saturated_seconds >= span - slack for e in estimates))


def compute_queueing_weights(
    inputs: Mapping[str, EndpointInput],
    readings: Mapping[str, Sequence[Reading]],
    policy: QueueingPolicy,
    now: float,
    previous: PoolWeights | None,
) -> PoolWeights:
    """Weights for one pool (keyed like ``inputs``). Never raises.

    ``readings`` holds each endpoint's recent counter reads (any order; those outside the
    window are ignored; an endpoint may have none). ``previous`` is the last result for this
    pool: it carries the service-rate estimates, the deadband's reference, ``hold`` and
    fail-static. An empty pool yields no endpoints and ``fail_static=False``.
    """
    shared = policy.shared()
    pool = assess_pool(inputs, shared, now, previous)
    tiers = (capacity_tiers({a: x.capacity for a, x in pool.assessed.items()})
             if policy.capacity_tiers else {})
    if pool.fail_static is not None:  # every endpoint held: so is its locality
        held_tiers = {a: (ew.locality if (ew := pool.held.get(a)) is not None
                          and ew.locality else t) for a, t in tiers.items()}
        return _with_localities(pool.fail_static, held_tiers,
                                previous.localities if previous is not None else {})
    held, usable = pool.held, pool.usable
    estimates = []
    for address, a in usable.items():
        r = rates(readings.get(address, ()), now, policy)
        estimates.append(_Estimate(address, a, r, _service_rate(r, held.get(address), policy),
                                   a.capacity))
    if tiers:
        _tier_rates(estimates, tiers, held, policy)
    mu = _filled(estimates)
    lam = sum(e.rates.throughput or 0.0 for e in estimates)
    rated = any(e.service_rate is not None for e in estimates)
    split_applied = policy.split in SPLITS and rated and lam > 0
    split = SPLITS[policy.split](mu, lam) if split_applied else dict(mu)
    shares, backlogs = _shares(estimates, mu, split, rated, policy)
    left_out = {a for a, r in split.items() if r <= 0} if split_applied else set()
    degraded = _degraded(estimates, policy)
    excess = pool_excess(readings, mu.keys(), now, policy.window_seconds) if rated else None
    groups = tiers or capacity_tiers({e.address: e.capacity for e in estimates})
    overloaded = excess is not None and excess.overloaded and (
        _was_overloaded(previous) or _saturated_throughout(
            [e for e in estimates if e.address not in slowest_tier(mu, groups)],
            excess.span, policy))
    if overloaded:  # every endpoint at its rate, the excess on the slowest tier (overload.py)
        assert excess is not None
        shares = overload_split(
            mu, groups, {e.address: e.rates.done for e in estimates},
            {e.address: e.rates.work for e in estimates}, excess.arrival_rate)
        left_out, degraded = set(), set()  # the pool needs every endpoint: none idled
    share_units = _units(shares, policy)
    per_request = _work_per_request(estimates)
    if tiers:
        plan = plan_localities(tiers, shares, left_out, degraded,
                               max_weight=policy.max_weight,
                               equal_hosts=policy.active_request_bias > 0 or policy.equal_hosts,
                               standby=policy.standby and not overloaded,
                               max_standby_share=policy.max_standby_share,
                               previous=previous.localities if previous is not None else {},
                               smooth=lambda t, p: smooth(t, p, policy))
        units: Mapping[str, float] = plan.host_units
        idle: Collection[str] = plan.standby
    else:
        # what Envoy's least_request will divide by, multiplied in so its picks follow the
        # shares
        bias = policy.active_request_bias
        scaled = {e.address: shares[e.address]
                  * (1.0 + _in_flight_at_share(e, shares[e.address], rated)) ** bias
                  for e in estimates}
        units = _units(scaled, policy)
        idle = set() if overloaded else _standby(units, left_out, policy)
    endpoints = {e.address: _endpoint(e, mu[e.address], shares[e.address],
                                      units.get(e.address, MIN_WEIGHT),
                                      backlogs[e.address], held.get(e.address), policy,
                                      e.address in idle, e.address in degraded,
                                      share_units[e.address], rated, per_request)
                 for e in estimates}
    if overloaded:
        assert excess is not None
        endpoints = {a: replace(ew, breakdown={**ew.breakdown,
                                                "pool_excess_share": excess.share})
                     for a, ew in endpoints.items()}
    weights = complete_pool(pool, endpoints, shared)
    return _with_localities(weights, tiers, plan.weights) if tiers else weights


def _with_localities(weights: PoolWeights, tiers: Mapping[str, str],
                     localities: Mapping[str, int]) -> PoolWeights:
    """Every endpoint's locality and the localities' weights on ``weights`` (a locality
    missing from ``localities``, e.g. new in a fail-static tick, gets weight 1)."""
    if not tiers:
        return weights
    endpoints = {a: replace(ew, locality=tiers.get(a)) for a, ew in weights.endpoints.items()}
    named = {t: localities.get(t, MIN_WEIGHT) for t in set(tiers.values())}
    return replace(weights, endpoints=endpoints, localities=named)
