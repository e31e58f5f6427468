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

import math
import numbers
import operator
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import combinations
from typing import Literal, NamedTuple

from weight_calculator.health import DEGRADED, HEALTHY, INVALID, STALE
from weight_calculator.types import EndpointWeight, PoolWeights

Staleness = Literal["saturated", "hold", "ignore"]
STALENESS_MODES: tuple[str, ...] = ("saturated", "hold", "ignore")
MIN_WEIGHT = 1  # Envoy NACKs 0

# signal -> (lowest valid, highest valid, lower bound exclusive)
_BOUNDS: Mapping[str, tuple[float, float, bool]] = {
    "kv_usage": (0.0, 1.0, False),
    "gpu_mem_pct": (0.0, 100.0, False),
    "queue": (0.0, math.inf, False),
    "running": (0.0, math.inf, False),
    "itl_ms": (0.0, math.inf, False),
    "capacity": (0.0, math.inf, True),
    "collected_at": (-math.inf, math.inf, False),
}
_ALIASES = {"kv_capacity_tokens": "capacity"}
# The same bounds with infinities replaced by the largest finite float, so that one chained
# comparison (``lo <= v <= hi``) also rejects NaN and +-inf.
_RANGES: Mapping[str, tuple[float, float, bool]] = {
    name: (max(lo, -sys.float_info.max), min(hi, sys.float_info.max), exclusive)
    for name, (lo, hi, exclusive) in _BOUNDS.items()
}


@dataclass(frozen=True, slots=True)  # slots: ~40% cheaper to build, 10k a tick
class Signals:
    """Load signals of one endpoint; ``None`` = not available."""

    kv_usage: float | None = None  # KV-cache use, 0..1
    gpu_mem_pct: float | None = None  # framebuffer use, 0..100
    queue: float | None = None  # waiting requests
    running: float | None = None  # running requests (reported, not weighted)
    itl_ms: float | None = None  # recent mean inter-token latency, milliseconds
    capacity: float | None = None  # KV-cache capacity in tokens

    def as_dict(self) -> dict[str, float]:
        """The present signals as ``name -> value``."""
        return {
            n: v for n, v in zip(_SIGNAL_NAMES, _signal_values(self), strict=True) if v is not None
        }

    @classmethod
    def from_mapping(cls, values: Mapping[str, float]) -> Signals:
        """Build from a flat mapping (e.g. ``Sample.signals``); unknown keys are ignored and
        ``kv_capacity_tokens`` is accepted for ``capacity``."""
        if values.keys() <= _SIGNAL_SET:  # the common case: nothing to drop or rename
            return cls(**values)
        known: dict[str, float] = {}
        for key, value in values.items():
            name = _ALIASES.get(key, key)
            if name in _SIGNAL_SET:
                known[name] = value
        return cls(**known)


_SIGNAL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Signals))
_SIGNAL_SET = frozenset(_SIGNAL_NAMES)
_signal_values = operator.attrgetter(*_SIGNAL_NAMES)  # Signals -> every field, in order
_INPUT_KEYS = {name: f"input.{name}" for name in _SIGNAL_NAMES}  # breakdown key per signal
_SIGNAL_RANGES = tuple(_RANGES[name] for name in _SIGNAL_NAMES)


@dataclass(frozen=True, slots=True)  # slots: ~40% cheaper to build, 10k a tick
class EndpointInput:
    """What the caller knows about one endpoint this tick."""

    signals: Signals | None  # last good signals, None if never read
    collected_at: float | None  # when ``signals`` were read (unix seconds)
    error: str | None = None  # error of the latest read attempt; None if it succeeded
    configured_capacity: float | None = None  # KV tokens, from config; used if no signal


@dataclass(frozen=True)
class CompositePolicy:
    """Knobs of the composite policy (see the module docstring for the formulae)."""

    memory_mix: float = 0.40
    queue_mix: float = 0.35
    latency_mix: float = 0.25
    queue_cap: float = 32.0
    itl_slo_ms: float = 50.0
    max_weight: int = 100
    ewma_alpha: float = 0.5
    deadband: float = 3.0
    kv_degraded: float = 0.95
    staleness: Staleness = "saturated"
    stale_after_seconds: float = 6.0

    def __post_init__(self) -> None:
        mixes = (self.memory_mix, self.queue_mix, self.latency_mix)
        if not all(math.isfinite(m) and m >= 0 for m in mixes) or sum(mixes) <= 0:
            raise ValueError(f"mix weights must be finite, >= 0 and not all 0, got {mixes}")
        self._require("queue_cap", 0 < self.queue_cap < math.inf, "finite and > 0")
        self._require("itl_slo_ms", 0 < self.itl_slo_ms < math.inf, "finite and > 0")
        self._require("max_weight", self.max_weight >= MIN_WEIGHT, ">= 1")
        self._require("ewma_alpha", 0 < self.ewma_alpha <= 1, "in (0, 1]")
        self._require("deadband", 0 <= self.deadband < math.inf, "finite and >= 0")
        self._require("kv_degraded", 0 < self.kv_degraded <= 1, "in (0, 1]")
        self._require("staleness", self.staleness in STALENESS_MODES, f"in {STALENESS_MODES}")
        ok = 0 <= self.stale_after_seconds < math.inf
        self._require("stale_after_seconds", ok, "finite and >= 0")

    def _require(self, name: str, ok: bool, rule: str) -> None:
        if not ok:
            raise ValueError(f"CompositePolicy.{name} must be {rule}, got {getattr(self, name)!r}")

    def mix(self) -> dict[str, float]:
        return {"memory": self.memory_mix, "queue": self.queue_mix, "latency": self.latency_mix}


# --- per-tick constants -----------------------------------------------------------------------

_LOAD_KEYS: tuple[str, ...] = ("memory", "queue", "latency")  # the order of ``policy.mix()``
_LOAD_SOURCES: Mapping[str, str] = {
    "kv_usage": "memory",
    "gpu_mem_pct": "memory",
    "queue": "queue",
    "itl_ms": "latency",
}


class _Term(NamedTuple):
    """One mixed load key of an endpoint, with its share of the mix and breakdown keys."""

    key: str
    share: float  # its mix / the sum of the mixes of the keys present
    norm_key: str
    mix_key: str
    share_key: str


@dataclass(frozen=True)
class _Plan:
    """What the policy implies for every endpoint, worked out once per call."""

    feeding: frozenset[str]  # signals that feed a load key with a non-zero mix
    no_load: str  # the reason given to an endpoint with none of them
    terms: Mapping[tuple[str, ...], tuple[_Term, ...]]  # load keys present -> mixed terms

    @classmethod
    def of(cls, policy: CompositePolicy) -> _Plan:
        mix = policy.mix()
        weighted = [k for k, m in mix.items() if m > 0]
        terms: dict[tuple[str, ...], tuple[_Term, ...]] = {}
        for size in range(1, len(_LOAD_KEYS) + 1):
            for present in combinations(_LOAD_KEYS, size):
                used = {k: mix[k] for k in present if mix[k] > 0}
                total = sum(used.values())
                if total > 0:
                    terms[present] = tuple(
                        _Term(k, m / total, f"norm.{k}", f"mix.{k}", f"share.{k}")
                        for k, m in used.items()
                    )
        return cls(
            feeding=frozenset(s for s, k in _LOAD_SOURCES.items() if k in weighted),
            no_load=f"no load signal with a non-zero mix (mixed: {', '.join(weighted)})",
            terms=terms,
        )


# --- per-endpoint assessment ------------------------------------------------------------------


@dataclass(slots=True)
class _Assessed:
    """An endpoint's inputs after validation and the staleness check."""

    status: str  # HEALTHY (usable), STALE or INVALID
    reason: str
    signals: Mapping[str, float]
    updated_at: float | None
    capacity: float | None  # valid capacity (signal, else configured), None if unknown
    last_failed: bool  # the latest read attempt failed, or there never was a good one

    @property
    def usable(self) -> bool:
        return self.status == HEALTHY


def _as_float(value: object) -> float | None:
    """``float(value)`` for real numbers (not bools), else ``None``."""
    if type(value) is float or type(value) is int:  # fast path for the common case
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _invalid_value(name: str, value: object) -> bool:
    lo, hi, exclusive = _RANGES[name]  # finite: the comparisons reject NaN and +-inf
    v = value if type(value) is float else _as_float(value)
    if v is None:
        return True
    return not (lo < v <= hi if exclusive else lo <= v <= hi)


def _validated(signals: Signals, configured: float | None, plan: _Plan) -> dict[str, float] | str:
    """The present signals as floats, or the first reason these inputs are unusable."""
    clean: dict[str, float] = {}
    values = _signal_values(signals)
    for name, value, (lo, hi, exclusive) in zip(_SIGNAL_NAMES, values, _SIGNAL_RANGES, strict=True):
        if value is None:
            continue
        v = value if type(value) is float else _as_float(value)
        if v is None or not (lo < v <= hi if exclusive else lo <= v <= hi):
            return f"invalid {name}={value!r}"
        clean[name] = v
    if configured is not None and _invalid_value("capacity", configured):
        return f"invalid configured_capacity={configured!r}"
    if plan.feeding.isdisjoint(clean):
        return plan.no_load
    return clean


def _assess(inp: EndpointInput, policy: CompositePolicy, plan: _Plan, now: float) -> _Assessed:
    failed = inp.error is not None or inp.signals is None
    suffix = f" ({inp.error})" if inp.error else ""
    if inp.signals is None or inp.collected_at is None:
        return _Assessed(STALE, f"no telemetry yet{suffix}", {}, None, None, True)
    if _invalid_value("collected_at", inp.collected_at):
        reason = f"invalid collected_at={inp.collected_at!r}"
        return _Assessed(INVALID, reason, {}, None, None, failed)
    signals = _validated(inp.signals, inp.configured_capacity, plan)
    if isinstance(signals, str):
        return _Assessed(INVALID, signals, inp.signals.as_dict(), inp.collected_at, None, failed)
    capacity = signals.get("capacity", inp.configured_capacity)
    age = now - inp.collected_at
    if not age <= policy.stale_after_seconds:  # also catches NaN
        reason = f"stale {age:.1f}s > {policy.stale_after_seconds:g}s{suffix}"
        return _Assessed(STALE, reason, signals, inp.collected_at, capacity, failed)
    reason = f"last read failed{suffix}, using sample {age:.1f}s old" if failed else "ok"
    return _Assessed(HEALTHY, reason, signals, inp.collected_at, capacity, failed)


# --- capacity ---------------------------------------------------------------------------------


def _capacity_scale(
    assessed: Mapping[str, _Assessed], policy: CompositePolicy
) -> tuple[float, float]:
    """``(pool max, typical)`` capacity; ``(1, 1)`` when no endpoint knows its own.

    An endpoint's relative capacity is ``(its capacity, else typical) / pool max`` (see the
    module docstring).
    """
    counted = [
        a.capacity
        for a in assessed.values()
        if a.capacity is not None
        and (a.usable or (a.status == STALE and policy.staleness != "ignore"))
    ]
    if not counted:
        return 1.0, 1.0
    return max(counted), statistics.median(counted)


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


def _clamp(weight: float, policy: CompositePolicy) -> int:
    """``int(max(MIN_WEIGHT, min(policy.max_weight, weight)))``, without the builtin calls."""
    top = policy.max_weight
    capped = weight if weight < top else top
    return int(capped if capped > MIN_WEIGHT else MIN_WEIGHT)


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


def _finite(signals: Mapping[str, float]) -> dict[str, float]:
    """Only finite real values: a rejected input is named in ``reason``, never copied."""
    out: dict[str, float] = {}
    for name, value in signals.items():
        v = _as_float(value)
        if v is not None and math.isfinite(v):
            out[name] = v
    return out


def _inputs(signals: Mapping[str, float]) -> dict[str, float]:
    """Breakdown entries for inputs that may not have been validated (finite ones only)."""
    return {_INPUT_KEYS[name]: value for name, value in _finite(signals).items()}


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


def _unusable_weight(
    a: _Assessed, previous: EndpointWeight | None, neutral: int, policy: CompositePolicy
) -> EndpointWeight:
    """Weight of a stale or invalid endpoint under ``policy.staleness``."""
    if policy.staleness == "hold":
        weight = previous.weight if previous is not None else MIN_WEIGHT
        how = "holding previous weight" if previous is not None else "no previous weight"
    elif policy.staleness == "ignore":
        weight, how = neutral, "ignored: neutral weight"
    else:
        weight, how = MIN_WEIGHT, "saturated"
    weight = _clamp(weight, policy)
    return EndpointWeight(
        weight=weight,
        stale=True,
        saturated=True,
        signals=_finite(a.signals),
        updated_at=a.updated_at,
        reason=f"{a.reason}: {how}",
        health=a.status,
        breakdown={**_inputs(a.signals), "weight": float(weight)},
    )


def _fail_static(
    assessed: Mapping[str, _Assessed], held: Mapping[str, EndpointWeight], policy: CompositePolicy
) -> PoolWeights:
    """Every endpoint unusable: hold each previous weight (1 where unknown)."""
    endpoints: dict[str, EndpointWeight] = {}
    for address, a in assessed.items():
        prior = held.get(address)
        weight = _clamp(prior.weight if prior is not None else MIN_WEIGHT, policy)
        endpoints[address] = EndpointWeight(
            weight=weight,
            stale=True,
            saturated=True,
            signals=_finite(a.signals),
            updated_at=a.updated_at,
            reason=f"fail-static: {a.reason}",
            health=a.status,
            breakdown={**_inputs(a.signals), "weight": float(weight)},
        )
    return PoolWeights(endpoints=endpoints, fail_static=True)


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


@dataclass(frozen=True)
class PoolAssessment:
    """One pool's endpoints after validation and the staleness check, in address order;
    ``fail_static`` is set when none is usable. Shared by every policy built on this one."""

    assessed: Mapping[str, _Assessed]
    held: Mapping[str, EndpointWeight]  # the previous weights
    usable: Mapping[str, _Assessed]
    plan: _Plan
    fail_static: PoolWeights | None


def assess_pool(inputs: Mapping[str, EndpointInput], policy: CompositePolicy, now: float,
                previous: PoolWeights | None) -> PoolAssessment:
    plan = _Plan.of(policy)
    assessed = {address: _assess(inputs[address], policy, plan, now) for address in sorted(inputs)}
    held = previous.endpoints if previous is not None else {}
    usable = {address: a for address, a in assessed.items() if a.usable}
    frozen = _fail_static(assessed, held, policy) if assessed and not usable else None
    return PoolAssessment(assessed, held, usable, plan, frozen)


def complete_pool(pool: PoolAssessment, endpoints: Mapping[str, EndpointWeight],
                  policy: CompositePolicy) -> PoolWeights:
    """The usable endpoints' ``endpoints`` plus a weight for every unusable one (stale or
    invalid, under ``policy.staleness``), in address order."""
    if len(endpoints) == len(pool.assessed):  # already in address order
        return PoolWeights(endpoints=endpoints, fail_static=False)
    neutral = statistics.median_low([ew.weight for ew in endpoints.values()])
    ordered = {
        address: endpoints[address]
        if a.usable
        else _unusable_weight(a, pool.held.get(address), neutral, policy)
        for address, a in pool.assessed.items()
    }
    return PoolWeights(endpoints=ordered, fail_static=False)
