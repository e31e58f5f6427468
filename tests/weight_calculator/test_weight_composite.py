"""Tests for the composite (memory + queue + latency, capacity-scaled) weight policy."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.paths import METRICS_FIXTURES
from weight_calculator.composite import compute_composite_weights
from weight_calculator.health import DEGRADED, HEALTHY, INVALID, STALE
from weight_calculator.inputs import CompositePolicy, EndpointInput, Signals
from weight_calculator.types import EndpointWeight, PoolWeights
from xds_server.telemetry.parsers import page_signals

NOW = 1_700_000_000.0
POLICY = CompositePolicy()
FIXTURES = METRICS_FIXTURES


def fresh(signals: Signals, **kw: object) -> EndpointInput:
    return EndpointInput(signals=signals, collected_at=NOW - 1.0, **kw)  # type: ignore[arg-type]


def stale(signals: Signals | None = None) -> EndpointInput:
    return EndpointInput(signals=signals, collected_at=NOW - 60.0 if signals else None)


def weights(
    inputs: dict[str, EndpointInput],
    policy: CompositePolicy = POLICY,
    previous: PoolWeights | None = None,
) -> dict[str, int]:
    result = compute_composite_weights(inputs, policy, NOW, previous)
    return {address: ew.weight for address, ew in result.endpoints.items()}


def held(**pool: int) -> PoolWeights:
    endpoints = {
        a.replace("_", ":"): EndpointWeight(w, False, False, {}, NOW) for a, w in pool.items()
    }
    return PoolWeights(endpoints=endpoints, fail_static=False)


# --- normalisation and mix ------------------------------------------------------------------


def test_idle_endpoints_get_the_maximum() -> None:
    idle = Signals(kv_usage=0.0, queue=0.0, itl_ms=0.0)
    assert weights({"a:1": fresh(idle), "b:1": fresh(idle)}) == {"a:1": 100, "b:1": 100}


def test_mixed_load_formula() -> None:
    # memory 0.25, queue 8/32 = 0.25, latency (50/50)/2 = 0.5
    # load = 0.40*0.25 + 0.35*0.25 + 0.25*0.5 = 0.3125 -> headroom 0.6875 -> 68.75 -> 69
    signals = Signals(kv_usage=0.25, queue=8.0, itl_ms=50.0)
    result = compute_composite_weights({"a:1": fresh(signals)}, POLICY, NOW, None)
    ew = result.endpoints["a:1"]
    assert ew.weight == 69 and ew.health == HEALTHY and ew.reason == "ok"
    assert ew.breakdown["norm.latency"] == 0.5
    assert ew.breakdown["headroom"] == pytest.approx(0.6875)
    shares = sum(v for k, v in ew.breakdown.items() if k.startswith("share."))
    assert shares == pytest.approx(ew.breakdown["score"])


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        (Signals(kv_usage=0.5), 50),  # mix renormalised over the one signal present
        (Signals(gpu_mem_pct=30.0), 70),  # memory from FB use when no kv_usage
        (Signals(kv_usage=0.2, gpu_mem_pct=90.0), 80),  # kv_usage wins over gpu_mem_pct
        (Signals(queue=16.0), 50),
        (Signals(itl_ms=100.0), 1),  # twice the SLO: latency 1.0, score 0 -> floor 1
        (Signals(itl_ms=500.0), 1),  # latency capped at 2x SLO
        (Signals(itl_ms=25.0), 75),
        (Signals(kv_usage=0.5, queue=0.0), round(100 * (1 - 0.4 / 0.75 * 0.5))),
    ],
)
def test_single_endpoint_normalisation(signals: Signals, expected: int) -> None:
    assert weights({"a:1": fresh(signals)}) == {"a:1": expected}


def test_running_is_reported_but_not_weighted() -> None:
    a = weights({"a:1": fresh(Signals(kv_usage=0.3, running=0.0))})
    b = weights({"a:1": fresh(Signals(kv_usage=0.3, running=500.0))})
    assert a == b == {"a:1": 70}


# --- capacity -------------------------------------------------------------------------------


def test_idle_small_gpu_does_not_outweigh_idle_big_gpu() -> None:
    idle = {"kv_usage": 0.0, "queue": 0.0}
    pool = {
        "h100:1": fresh(Signals(capacity=400_000.0, **idle)),
        "l4:1": fresh(Signals(capacity=60_000.0, **idle)),
    }
    assert weights(pool) == {"h100:1": 100, "l4:1": 15}


def test_busy_big_gpu_can_fall_below_idle_small_gpu() -> None:
    pool = {
        "h100:1": fresh(Signals(kv_usage=0.9, queue=20.0, capacity=400_000.0)),
        "l4:1": fresh(Signals(kv_usage=0.0, queue=0.0, capacity=200_000.0)),
    }
    got = weights(pool)
    assert got["h100:1"] < got["l4:1"] == 50


def test_configured_capacity_is_the_fallback() -> None:
    pool = {
        "a:1": fresh(Signals(kv_usage=0.0), configured_capacity=100.0),
        "b:1": fresh(Signals(kv_usage=0.0, capacity=50.0), configured_capacity=100.0),
        "c:1": fresh(Signals(kv_usage=0.0), configured_capacity=25.0),
    }
    assert weights(pool) == {"a:1": 100, "b:1": 50, "c:1": 25}


def test_unknown_capacity_counts_as_the_pool_median() -> None:
    pool = {
        "a:1": fresh(Signals(kv_usage=0.0, capacity=100.0)),
        "b:1": fresh(Signals(kv_usage=0.0, capacity=20.0)),
        "c:1": fresh(Signals(kv_usage=0.0, capacity=40.0)),
        "d:1": fresh(Signals(kv_usage=0.0)),
    }
    assert weights(pool)["d:1"] == 40


def test_stale_big_gpu_still_sets_the_scale_unless_ignored() -> None:
    pool = {
        "h100:1": EndpointInput(Signals(kv_usage=0.0, capacity=400_000.0), NOW - 60.0),
        "l4:1": fresh(Signals(kv_usage=0.0, capacity=60_000.0)),
    }
    assert weights(pool)["l4:1"] == 15
    ignore = dataclasses.replace(POLICY, staleness="ignore")
    assert weights(pool, ignore) == {"h100:1": 100, "l4:1": 100}


# --- hard limits ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signals", "reason"),
    [
        (Signals(kv_usage=0.95, queue=0.0), "kv_usage 0.95 >= 0.95"),
        (Signals(kv_usage=0.1, queue=32.0), "queue 32 >= queue_cap 32"),
    ],
)
def test_degraded_is_immediate(signals: Signals, reason: str) -> None:
    result = compute_composite_weights({"a:1": fresh(signals)}, POLICY, NOW, held(a_1=90))
    ew = result.endpoints["a:1"]
    assert (ew.weight, ew.health, ew.saturated) == (1, DEGRADED, False)
    assert reason in ew.reason
    assert not result.fail_static


def test_all_degraded_is_not_fail_static() -> None:
    full = Signals(kv_usage=0.99)
    result = compute_composite_weights(
        {"a:1": fresh(full), "b:1": fresh(full)}, POLICY, NOW, held(a_1=80, b_1=20)
    )
    assert not result.fail_static
    assert {ew.weight for ew in result.endpoints.values()} == {1}


# --- staleness ------------------------------------------------------------------------------


def _stale_pool() -> dict[str, EndpointInput]:
    return {
        "a:1": fresh(Signals(kv_usage=0.2)),  # 80
        "b:1": fresh(Signals(kv_usage=0.6)),  # 40
        "c:1": fresh(Signals(kv_usage=0.9)),  # 10
        "old:1": stale(Signals(kv_usage=0.0)),
        "never:1": stale(None),
    }


@pytest.mark.parametrize(
    ("mode", "old", "never"),
    [("saturated", 1, 1), ("hold", 70, 1), ("ignore", 40, 40)],
)
def test_staleness_modes(mode: str, old: int, never: int) -> None:
    policy = dataclasses.replace(POLICY, staleness=mode)  # type: ignore[arg-type]
    result = compute_composite_weights(_stale_pool(), policy, NOW, held(old_1=70))
    got = {a: ew.weight for a, ew in result.endpoints.items()}
    assert got == {"a:1": 80, "b:1": 40, "c:1": 10, "old:1": old, "never:1": never}
    assert result.endpoints["old:1"].health == STALE and result.endpoints["old:1"].saturated
    assert "no telemetry yet" in result.endpoints["never:1"].reason
    assert not result.fail_static


def test_stale_boundary_is_inclusive() -> None:
    at_limit = EndpointInput(Signals(kv_usage=0.5), NOW - POLICY.stale_after_seconds)
    beyond = EndpointInput(Signals(kv_usage=0.5), NOW - POLICY.stale_after_seconds - 0.001)
    result = compute_composite_weights({"a:1": at_limit, "b:1": beyond}, POLICY, NOW, None)
    assert result.endpoints["a:1"].health == HEALTHY
    assert result.endpoints["b:1"].health == STALE


def test_failed_read_with_fresh_sample_is_still_weighted() -> None:
    inp = fresh(Signals(kv_usage=0.5), error="timeout: no answer")
    ew = compute_composite_weights({"a:1": inp}, POLICY, NOW, None).endpoints["a:1"]
    assert (ew.weight, ew.stale, ew.saturated, ew.health) == (50, True, False, HEALTHY)
    assert "timeout" in ew.reason


@pytest.mark.parametrize("mode", ["saturated", "hold", "ignore"])
def test_all_stale_pool_is_fail_static(mode: str) -> None:
    policy = dataclasses.replace(POLICY, staleness=mode)  # type: ignore[arg-type]
    pool = {"a:1": stale(Signals(kv_usage=0.1)), "b:1": stale(None), "c:1": stale(None)}
    result = compute_composite_weights(pool, policy, NOW, held(a_1=77, b_1=33))
    assert result.fail_static
    assert {a: ew.weight for a, ew in result.endpoints.items()} == {"a:1": 77, "b:1": 33, "c:1": 1}
    assert all(ew.reason.startswith("fail-static") for ew in result.endpoints.values())


def test_empty_pool() -> None:
    assert compute_composite_weights({}, POLICY, NOW, None) == PoolWeights({}, False)


# --- invalid inputs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        Signals(kv_usage=math.nan),
        Signals(kv_usage=1.01),
        Signals(kv_usage=-0.01),
        Signals(gpu_mem_pct=101.0),
        Signals(kv_usage=0.1, queue=-1.0),
        Signals(kv_usage=0.1, queue=math.inf),
        Signals(kv_usage=0.1, itl_ms=math.nan),
        Signals(kv_usage=0.1, running=-3.0),
        Signals(kv_usage=0.1, capacity=0.0),
        Signals(kv_usage=0.1, capacity=math.nan),
        Signals(kv_usage=True),  # type: ignore[arg-type]
        Signals(kv_usage="0.5"),  # type: ignore[arg-type]
        Signals(running=3.0),  # no load signal at all
    ],
)
def test_invalid_inputs_are_flagged_and_treated_as_stale(bad: Signals) -> None:
    pool = {"ok:1": fresh(Signals(kv_usage=0.5)), "bad:1": fresh(bad)}
    for mode, expected in (("saturated", 1), ("hold", 64), ("ignore", 50)):
        policy = dataclasses.replace(POLICY, staleness=mode)  # type: ignore[arg-type]
        result = compute_composite_weights(pool, policy, NOW, held(bad_1=64))
        ew = result.endpoints["bad:1"]
        assert (ew.weight, ew.health, ew.stale) == (expected, INVALID, True), mode
        assert all(math.isfinite(v) for v in ew.breakdown.values())
        assert all(math.isfinite(v) for v in ew.signals.values())


def test_invalid_configured_capacity_and_timestamp() -> None:
    pool = {
        "a:1": fresh(Signals(kv_usage=0.5), configured_capacity=-5.0),
        "b:1": EndpointInput(Signals(kv_usage=0.5), collected_at=math.nan),
        "c:1": fresh(Signals(kv_usage=0.5)),
    }
    result = compute_composite_weights(pool, POLICY, NOW, None)
    assert "configured_capacity" in result.endpoints["a:1"].reason
    assert "collected_at" in result.endpoints["b:1"].reason
    assert [result.endpoints[a].health for a in ("a:1", "b:1", "c:1")] == [
        INVALID,
        INVALID,
        HEALTHY,
    ]


def test_present_signal_with_zero_mix_is_not_a_load_signal() -> None:
    policy = dataclasses.replace(POLICY, latency_mix=0.0)
    result = compute_composite_weights({"a:1": fresh(Signals(itl_ms=5.0))}, policy, NOW, None)
    assert result.fail_static and result.endpoints["a:1"].health == INVALID


# --- smoothing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("previous", "alpha", "expected"),
    [
        (52, 0.5, 52),  # target 50: |50-52| < 3 -> deadband keeps 52
        (48, 0.5, 48),
        (53, 0.5, 52),  # |50-53| = 3 -> EWMA: 0.5*50 + 0.5*53 = 51.5 -> 52 (half to even)
        (90, 0.5, 70),
        (10, 0.5, 30),
        (90, 1.0, 50),  # alpha 1: no smoothing
        (90, 0.25, 80),  # 0.25*50 + 0.75*90 = 80
        (500, 0.5, 100),  # out-of-range previous is clamped
    ],
)
def test_deadband_and_ewma(previous: int, alpha: float, expected: int) -> None:
    policy = dataclasses.replace(POLICY, ewma_alpha=alpha)
    got = weights({"a:1": fresh(Signals(kv_usage=0.5))}, policy, held(a_1=previous))
    assert got == {"a:1": expected}


def test_the_deadband_is_relative_for_small_weights() -> None:
    """An absolute band of 3 froze an L4 at weight 6 (issue 11): the band is at most 10 % of
    the previous weight, so a target of 4 moves it (the old code kept 6)."""
    inputs = {"a:1": fresh(Signals(kv_usage=0.96))}
    policy = dataclasses.replace(POLICY, kv_degraded=1.0)
    # target round(100 * 0.04) = 4: |4 - 6| = 2 < 3 but not < 0.6 -> EWMA to 5
    assert weights(inputs, policy, held(a_1=6)) == {"a:1": 5}


def test_ewma_converges_to_within_the_deadband() -> None:
    previous: PoolWeights | None = held(a_1=1)
    inputs = {"a:1": fresh(Signals(kv_usage=0.2))}  # target 80
    trail = []
    for _ in range(12):
        previous = compute_composite_weights(inputs, POLICY, NOW, previous)
        trail.append(previous.endpoints["a:1"].weight)
    assert trail == sorted(trail)
    assert 80 - POLICY.deadband < trail[-1] <= 80


# --- config and interop ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"memory_mix": 0.0, "queue_mix": 0.0, "latency_mix": 0.0},
        {"memory_mix": math.nan},
        {"queue_cap": 0.0},
        {"itl_slo_ms": -1.0},
        {"max_weight": 0},
        {"ewma_alpha": 0.0},
        {"deadband": -1.0},
        {"kv_degraded": 1.5},
        {"staleness": "panic"},
        {"stale_after_seconds": math.inf},
    ],
)
def test_policy_validation(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="mix|CompositePolicy"):
        CompositePolicy(**changes)  # type: ignore[arg-type]


def test_signals_from_page_signals() -> None:
    flat = page_signals((FIXTURES / "vllm_v1.txt").read_text())
    signals = Signals.from_mapping(flat)
    assert signals == Signals(kv_usage=0.4375, queue=4.0, running=12.0, capacity=437360.0)
    assert signals.as_dict()["capacity"] == 437360.0


def test_endpoint_weight_defaults_keep_old_callers_working() -> None:
    ew = EndpointWeight(5, False, False, {}, None)
    assert ew.health == "HEALTHY" and dict(ew.breakdown) == {}


# --- properties -----------------------------------------------------------------------------

unit = st.floats(min_value=0.0, max_value=1.0)
maybe = st.none() | unit
load_signals = st.builds(
    Signals,
    kv_usage=maybe,
    gpu_mem_pct=st.none() | st.floats(min_value=0.0, max_value=100.0),
    queue=st.none() | st.floats(min_value=0.0, max_value=64.0),
    itl_ms=st.none() | st.floats(min_value=0.0, max_value=300.0),
    capacity=st.none() | st.floats(min_value=1.0, max_value=1e6),
).filter(lambda s: any(v is not None for v in (s.kv_usage, s.gpu_mem_pct, s.queue, s.itl_ms)))
policies = st.builds(
    CompositePolicy,
    ewma_alpha=st.floats(min_value=0.01, max_value=1.0),
    deadband=st.floats(min_value=0.0, max_value=10.0),
    max_weight=st.integers(min_value=1, max_value=1000),
    staleness=st.sampled_from(["saturated", "hold", "ignore"]),
)


def _more(value: float | None, extra: float, top: float) -> float | None:
    return None if value is None else min(top, value + extra)


@given(s=load_signals, other=load_signals, extra=st.floats(min_value=0.0, max_value=100.0))
def test_more_load_never_raises_the_weight(s: Signals, other: Signals, extra: float) -> None:
    heavier = dataclasses.replace(
        s,
        kv_usage=_more(s.kv_usage, extra / 100, 1.0),
        gpu_mem_pct=_more(s.gpu_mem_pct, extra, 100.0),
        queue=_more(s.queue, extra, 64.0),
        itl_ms=_more(s.itl_ms, extra, 300.0),
    )
    light = weights({"a:1": fresh(s), "b:1": fresh(other)})
    heavy = weights({"a:1": fresh(heavier), "b:1": fresh(other)})
    assert heavy["a:1"] <= light["a:1"]


@given(s=load_signals, small=st.floats(1.0, 1e6), big=st.floats(1.0, 1e6))
def test_bigger_capacity_never_gets_less(s: Signals, small: float, big: float) -> None:
    small, big = min(small, big), max(small, big)
    pool = {
        "big:1": fresh(dataclasses.replace(s, capacity=big)),
        "small:1": fresh(dataclasses.replace(s, capacity=small)),
    }
    got = weights(pool)
    assert got["big:1"] >= got["small:1"]


anything = st.none() | st.floats(allow_nan=True, allow_infinity=True)
any_signals = st.none() | st.builds(
    Signals,
    kv_usage=anything,
    gpu_mem_pct=anything,
    queue=anything,
    running=anything,
    itl_ms=anything,
    capacity=anything,
)
any_input = st.builds(
    EndpointInput,
    signals=any_signals,
    collected_at=st.none() | st.floats(NOW - 30.0, NOW + 1.0) | st.just(math.nan),
    error=st.none() | st.just("boom"),
    configured_capacity=anything,
)
addresses = st.sampled_from([f"10.0.0.{i}:8000" for i in range(6)])


@settings(max_examples=300)
@given(
    pool=st.dictionaries(addresses, any_input, max_size=6),
    prev=st.dictionaries(addresses, st.integers(-5, 2000), max_size=6),
    policy=policies,
)
def test_results_are_bounded_complete_and_deterministic(
    pool: dict[str, EndpointInput], prev: dict[str, int], policy: CompositePolicy
) -> None:
    previous = PoolWeights(
        {a: EndpointWeight(w, False, False, {}, None) for a, w in prev.items()}, False
    )
    first = compute_composite_weights(pool, policy, NOW, previous)
    again = compute_composite_weights(dict(reversed(list(pool.items()))), policy, NOW, previous)
    assert first == again
    assert first.endpoints.keys() == pool.keys()
    for ew in first.endpoints.values():
        assert isinstance(ew.weight, int) and 1 <= ew.weight <= policy.max_weight
        assert all(math.isfinite(v) for v in ew.breakdown.values())


def test_nan_clock_makes_every_sample_stale() -> None:
    pool = {"a:1": fresh(Signals(kv_usage=0.1))}
    result = compute_composite_weights(pool, POLICY, math.nan, held(a_1=42))
    assert result.fail_static and result.endpoints["a:1"].weight == 42


# --- the implementation against a straightforward reference ---------------------------------

REF_BOUNDS = {  # signal -> (lowest, highest, lowest excluded)
    "kv_usage": (0.0, 1.0, False),
    "gpu_mem_pct": (0.0, 100.0, False),
    "queue": (0.0, math.inf, False),
    "running": (0.0, math.inf, False),
    "itl_ms": (0.0, math.inf, False),
    "capacity": (0.0, math.inf, True),
}


def _ref_number(value: object, lo: float, hi: float, exclusive: bool = False) -> float | None:
    """``float(value)`` if it is a real number (not a bool) within the bounds, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    if not math.isfinite(v) or v > hi or v < lo or (exclusive and v == lo):
        return None
    return v


def _ref_assess(
    inp: EndpointInput, policy: CompositePolicy
) -> tuple[str, dict[str, float], float | None]:
    """(status, clean signals, capacity) per the module docstring."""
    if inp.signals is None or inp.collected_at is None:
        return STALE, {}, None
    if _ref_number(inp.collected_at, -math.inf, math.inf) is None:
        return INVALID, {}, None
    raw = {k: v for k, v in dataclasses.asdict(inp.signals).items() if v is not None}
    clean = {k: _ref_number(v, *REF_BOUNDS[k]) for k, v in raw.items()}
    configured = inp.configured_capacity
    mix = {
        "kv_usage": policy.memory_mix,
        "gpu_mem_pct": policy.memory_mix,
        "queue": policy.queue_mix,
        "itl_ms": policy.latency_mix,
    }
    if (
        None in clean.values()
        or (configured is not None and _ref_number(configured, 0.0, math.inf, True) is None)
        or not any(mix.get(k, 0.0) > 0 for k in clean)
    ):
        return INVALID, {}, None
    signals = {k: v for k, v in clean.items() if v is not None}
    status = HEALTHY if NOW - inp.collected_at <= policy.stale_after_seconds else STALE
    return status, signals, signals.get("capacity", configured)


def _ref_target(signals: dict[str, float], relative: float, policy: CompositePolicy) -> int:
    norms = {}
    if "kv_usage" in signals:
        norms["memory"] = signals["kv_usage"]
    elif "gpu_mem_pct" in signals:
        norms["memory"] = signals["gpu_mem_pct"] / 100.0
    if "queue" in signals:
        norms["queue"] = min(signals["queue"] / policy.queue_cap, 1.0)
    if "itl_ms" in signals:
        norms["latency"] = min(signals["itl_ms"] / policy.itl_slo_ms, 2.0) / 2.0
    mix = {k: m for k, m in policy.mix().items() if k in norms and m > 0}
    load = sum(m / sum(mix.values()) * norms[k] for k, m in mix.items())  # in mix order
    return round((1.0 - load) * relative * policy.max_weight)


def _ref_weights(
    pool: dict[str, EndpointInput], policy: CompositePolicy, prior: dict[str, int]
) -> tuple[dict[str, tuple[int, str]], bool]:
    """``address -> (weight, health)`` and fail-static, restated from the module docstring."""

    def clamp(weight: float) -> int:
        return int(max(1, min(policy.max_weight, weight)))

    assessed = {a: _ref_assess(inp, policy) for a, inp in pool.items()}
    read = any(inp.signals is not None and inp.collected_at is not None for inp in pool.values())
    if pool and read and all(status != HEALTHY for status, _, _ in assessed.values()):
        # fail-static only after a loss: a pool never read is unread endpoint by endpoint
        return {a: (clamp(prior.get(a, 1)), status) for a, (status, _, _) in assessed.items()}, True
    counted = [
        float(capacity)
        for status, _, capacity in assessed.values()
        if capacity is not None
        and (status == HEALTHY or (status == STALE and policy.staleness != "ignore"))
    ]
    out: dict[str, tuple[int, str]] = {}
    for a, (status, signals, capacity) in assessed.items():
        if status != HEALTHY:
            continue
        own = float(capacity) if capacity is not None else None
        typical = statistics.median(counted) if counted else 1.0
        relative = (own if own is not None else typical) / max(counted) if counted else 1.0
        kv, queue = signals.get("kv_usage"), signals.get("queue")
        if (kv is not None and kv >= policy.kv_degraded) or (
            queue is not None and queue >= policy.queue_cap
        ):
            out[a] = (1, DEGRADED)
            continue
        target, before = clamp(_ref_target(signals, relative, policy)), prior.get(a)
        if before is None:
            weight = target
        elif abs(target - before) < min(policy.deadband, 0.1 * before):
            weight = clamp(before)
        else:
            weight = clamp(round(policy.ewma_alpha * target + (1 - policy.ewma_alpha) * before))
        out[a] = (weight, HEALTHY)
    neutral = statistics.median_low([w for w, _ in out.values()] or [1])
    for a, (status, _, _) in assessed.items():
        if status != HEALTHY:
            mode = policy.staleness
            weight = prior.get(a, 1) if mode == "hold" else neutral if mode == "ignore" else 1
            out[a] = (clamp(weight), status)
    return out, False


def _mostly(valid: st.SearchStrategy[float]) -> st.SearchStrategy[object]:
    """Usually a valid value or None, sometimes an edge or an invalid one."""
    odd = st.sampled_from([0.0, 0.95, 32.0, 3, -1.0, math.nan, math.inf, True])
    return st.one_of(st.none(), valid, valid, valid, odd)


ref_input = st.builds(
    EndpointInput,
    signals=st.one_of(
        st.none(),
        *[
            st.builds(
                Signals,
                kv_usage=_mostly(st.floats(0.0, 1.0)),
                gpu_mem_pct=_mostly(st.floats(0.0, 100.0)),
                queue=_mostly(st.floats(0.0, 40.0)),
                running=_mostly(st.floats(0.0, 64.0)),
                itl_ms=_mostly(st.floats(0.0, 150.0)),
                capacity=st.none() | st.floats(1.0, 1e6) | st.sampled_from([0.0, 100.0, 200]),
            )
        ]
        * 3,
    ),
    collected_at=st.one_of(
        st.just(NOW - 1.0), st.just(NOW - 6.0), st.sampled_from([NOW - 60.0, None, math.nan])
    ),
    error=st.none() | st.just("boom"),
    configured_capacity=st.none() | st.sampled_from([50.0, 100.0, 400, -1.0]),
)
ref_policies = st.builds(
    CompositePolicy,
    memory_mix=st.sampled_from([0.0, 0.4, 1.0]),
    queue_mix=st.sampled_from([0.0, 0.35]),
    latency_mix=st.sampled_from([0.25, 2.0]),
    queue_cap=st.sampled_from([32.0, 64.0]),
    ewma_alpha=st.floats(min_value=0.01, max_value=1.0),
    deadband=st.sampled_from([0.0, 1.0, 3.0]) | st.floats(min_value=0.0, max_value=10.0),
    max_weight=st.integers(min_value=1, max_value=1000),
    kv_degraded=st.sampled_from([0.95, 1.0]),
    staleness=st.sampled_from(["saturated", "hold", "ignore"]),
)


@settings(max_examples=400)
@given(
    pool=st.dictionaries(st.sampled_from([f"10.0.0.{i}:8000" for i in range(12)]), ref_input),
    prev=st.dictionaries(
        st.sampled_from([f"10.0.0.{i}:8000" for i in range(12)]), st.integers(-5, 1200)
    ),
    policy=ref_policies,
)
def test_matches_a_straightforward_reference(
    pool: dict[str, EndpointInput], prev: dict[str, int], policy: CompositePolicy
) -> None:
    previous = PoolWeights(
        {a: EndpointWeight(w, False, False, {}, None) for a, w in prev.items()}, False
    )
    result = compute_composite_weights(pool, policy, NOW, previous)
    expected, fail_static = _ref_weights(pool, policy, prev)
    got = {a: (ew.weight, ew.health) for a, ew in result.endpoints.items()}
    assert (got, result.fail_static) == (expected, fail_static)
    assert list(result.endpoints) == sorted(pool)
    for ew in result.endpoints.values():
        if ew.health == HEALTHY:  # the breakdown adds up, and names every input it used
            shares = sum(v for k, v in ew.breakdown.items() if k.startswith("share."))
            assert shares == pytest.approx(ew.breakdown["score"], abs=1e-9)
            assert ew.breakdown["weight"] == ew.weight
            assert {f"input.{k}" for k in ew.signals} <= ew.breakdown.keys()


def test_from_mapping_fast_and_general_paths_agree() -> None:
    assert Signals.from_mapping({"queue": 2.0, "kv_usage": 0.5}) == Signals(kv_usage=0.5, queue=2.0)
    renamed = Signals.from_mapping({"kv_usage": 0.5, "kv_capacity_tokens": 9.0, "junk": 1.0})
    assert renamed == Signals(kv_usage=0.5, capacity=9.0)
    assert Signals.from_mapping({}) == Signals()


def test_inputs_stay_frozen_values() -> None:
    signals = Signals(kv_usage=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        signals.kv_usage = 0.1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fresh(signals).collected_at = 0.0  # type: ignore[misc]
    assert dataclasses.replace(signals, queue=1.0).as_dict() == {"kv_usage": 0.5, "queue": 1.0}
    assert hash(signals) == hash(Signals(kv_usage=0.5))
