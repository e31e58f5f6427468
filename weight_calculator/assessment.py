"""The assessment every policy built on the composite one shares: each endpoint's inputs
validated and checked for staleness (:func:`assess_pool`), the pool's capacity scale, and the
weights of stale, invalid and fail-static endpoints (:func:`complete_pool`) per
``CompositePolicy.staleness``. A policy adds only the weight of its usable endpoints (see
:mod:`weight_calculator.composite`, :mod:`.queueing`, :mod:`.reference`). Pure functions."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations
from typing import NamedTuple

from weight_calculator.health import HEALTHY, INVALID, STALE
from weight_calculator.inputs import (
    _INPUT_KEYS,
    _SIGNAL_NAMES,
    _SIGNAL_RANGES,
    MIN_WEIGHT,
    CompositePolicy,
    EndpointInput,
    Signals,
    _as_float,
    _clamp,
    _invalid_value,
    _signal_values,
)
from weight_calculator.types import EndpointWeight, PoolWeights

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
    frozen = None
    if assessed and not usable:
        # fail-static holds the weights from before a loss; a pool none of whose endpoints
        # was ever read (no sample now, none behind a previous weight) lost nothing: each
        # endpoint is unread, as alone (weight 1, then warm-up gives the young ones
        # warmup_weight, WARMING: weight_calculator/adjust.py)
        never_read = (all(a.status == STALE and a.updated_at is None
                          for a in assessed.values())
                      and all(ew.updated_at is None for ew in held.values()))
        frozen = (PoolWeights(endpoints={address: _unusable_weight(a, held.get(address),
                                                                   MIN_WEIGHT, policy)
                                         for address, a in assessed.items()},
                              fail_static=False) if never_read else
                  _fail_static(assessed, held, policy))
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
