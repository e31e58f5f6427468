"""Tests for the pure GPU-memory weight functions."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weight_calculator import (
    EndpointWeight,
    GpuMemoryPolicy,
    Observation,
    PoolWeights,
    Sample,
    compute_pool_weights,
    gpu_memory_weight,
)
from weight_calculator.adjust import WARMING, flag_problems, warm_up, without_warm_up

NOW = 1_700_000_000.0
POLICY = GpuMemoryPolicy(stale_after_seconds=6.0)
pcts = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


def obs(pct: float | None, age: float = 1.0, error: str | None = None) -> Observation:
    """An observation whose sample is `age` seconds old (no sample when pct is None)."""
    if pct is None:
        return Observation(sample=None, error=error)
    signals = {"gpu_mem_pct": pct, "fb_used_mib": 1.0, "fb_free_mib": 1.0, "gpus": 1.0}
    return Observation(sample=Sample(collected_at=NOW - age, signals=signals), error=error)


# --- gpu_memory_weight -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pct", "expected"),
    [(0.0, 100), (50.0, 75), (100.0, 50), (40.0, 80), (99.0, 50), (1.2, 99), (2.0, 99)],
)
def test_formula_values(pct: float, expected: int) -> None:
    assert gpu_memory_weight(pct) == expected


def test_formula_rounds_half_to_even() -> None:
    # 100 - 1/2 = 99.5 -> 100 and 100 - 3/2 = 98.5 -> 98 (Python round, banker's rounding).
    assert gpu_memory_weight(1.0) == 100
    assert gpu_memory_weight(3.0) == 98


def test_formula_accepts_ints() -> None:
    assert gpu_memory_weight(20) == 90


@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -math.inf, -0.001, -5.0, 100.0001, 250.0, "50", None, True]
)
def test_formula_rejects_invalid(bad: object) -> None:
    with pytest.raises(ValueError):
        gpu_memory_weight(bad)  # type: ignore[arg-type]


@given(a=pcts, b=pcts)
def test_more_memory_never_raises_weight(a: float, b: float) -> None:
    low, high = min(a, b), max(a, b)
    assert gpu_memory_weight(high) <= gpu_memory_weight(low)


@given(p=pcts)
def test_weight_always_in_range(p: float) -> None:
    assert 1 <= gpu_memory_weight(p) <= 100


# --- compute_pool_weights: per endpoint ------------------------------------------------------


def test_fresh_sample_uses_formula() -> None:
    result = compute_pool_weights({"a:1": obs(50.0, age=2.0)}, POLICY, NOW, None)
    ew = result.endpoints["a:1"]
    assert result.fail_static is False
    assert (ew.weight, ew.stale, ew.saturated, ew.reason) == (75, False, False, "ok")
    assert ew.updated_at == NOW - 2.0
    assert ew.signals["gpu_mem_pct"] == 50.0


def test_signals_are_copied_not_shared() -> None:
    observation = obs(10.0)
    result = compute_pool_weights({"a:1": observation}, POLICY, NOW, None)
    assert observation.sample is not None
    assert result.endpoints["a:1"].signals == observation.sample.signals
    assert result.endpoints["a:1"].signals is not observation.sample.signals


def test_young_sample_with_error_is_stale_but_weighted() -> None:
    pool = {"a:1": obs(20.0, age=3.0, error="timeout: 1s"), "b:1": obs(60.0)}
    ew = compute_pool_weights(pool, POLICY, NOW, None).endpoints["a:1"]
    assert (ew.weight, ew.stale, ew.saturated) == (90, True, False)


def test_sample_exactly_at_limit_is_fresh() -> None:
    ew = compute_pool_weights({"a:1": obs(0.0, age=6.0)}, POLICY, NOW, None).endpoints["a:1"]
    assert (ew.weight, ew.saturated) == (100, False)


def test_old_sample_is_saturated_with_min_weight() -> None:
    pool = {"old:1": obs(0.0, age=8.1, error="connect: refused"), "ok:1": obs(50.0)}
    result = compute_pool_weights(pool, POLICY, NOW, None)
    ew = result.endpoints["old:1"]
    assert result.fail_static is False
    assert (ew.weight, ew.stale, ew.saturated) == (1, True, True)
    assert ew.reason == "stale 8.1s > 6s: saturated"
    assert ew.updated_at == NOW - 8.1
    assert result.endpoints["ok:1"].weight == 75


def test_never_seen_endpoint_is_saturated() -> None:
    pool = {"new:1": obs(None), "ok:1": obs(50.0)}
    ew = compute_pool_weights(pool, POLICY, NOW, None).endpoints["new:1"]
    assert (ew.weight, ew.stale, ew.saturated, ew.updated_at) == (1, True, True, None)
    assert ew.signals == {}
    assert ew.reason.startswith("no telemetry yet")


@pytest.mark.parametrize(
    "signals", [{}, {"gpu_mem_pct": math.nan}, {"gpu_mem_pct": 140.0}, {"gpu_mem_pct": "x"}]
)
def test_invalid_signal_is_saturated_not_raised(signals: dict) -> None:
    bad = Observation(sample=Sample(collected_at=NOW, signals=signals))
    result = compute_pool_weights({"bad:1": bad, "ok:1": obs(50.0)}, POLICY, NOW, None)
    ew = result.endpoints["bad:1"]
    assert (ew.weight, ew.saturated, ew.stale) == (1, True, True)
    assert "gpu_mem_pct" in ew.reason


def test_nan_collected_at_is_saturated_not_raised() -> None:
    bad = Observation(sample=Sample(collected_at=math.nan, signals={"gpu_mem_pct": 5.0}))
    result = compute_pool_weights({"bad:1": bad, "ok:1": obs(50.0)}, POLICY, NOW, None)
    assert result.endpoints["bad:1"].saturated is True


def test_policy_bounds_clamp_weights() -> None:
    policy = GpuMemoryPolicy(min_weight=5, max_weight=80)
    pool = {"idle:1": obs(0.0), "gone:1": obs(None)}
    result = compute_pool_weights(pool, policy, NOW, None)
    assert result.endpoints["idle:1"].weight == 80
    assert result.endpoints["gone:1"].weight == 5


@pytest.mark.parametrize(
    "kwargs",
    [{"min_weight": 0}, {"min_weight": 10, "max_weight": 5}, {"stale_after_seconds": math.nan}],
)
def test_policy_rejects_nonsense(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        GpuMemoryPolicy(**kwargs)


# --- compute_pool_weights: pool-wide ---------------------------------------------------------


def test_fail_static_without_previous_gives_equal_min_weights() -> None:
    pool = {"a:1": obs(10.0, age=60.0), "b:1": obs(None, error="connect: refused")}
    result = compute_pool_weights(pool, POLICY, NOW, None)
    assert result.fail_static is True
    assert {a: e.weight for a, e in result.endpoints.items()} == {"a:1": 1, "b:1": 1}
    assert all(e.stale and e.reason == "fail-static" for e in result.endpoints.values())


def test_fail_static_holds_previous_weights() -> None:
    previous = compute_pool_weights({"a:1": obs(0.0), "b:1": obs(80.0)}, POLICY, NOW, None)
    assert {a: e.weight for a, e in previous.endpoints.items()} == {"a:1": 100, "b:1": 60}
    later = NOW + 60.0
    pool = {"a:1": obs(0.0, age=61.0), "b:1": obs(80.0, age=61.0), "c:1": obs(None)}
    result = compute_pool_weights(pool, POLICY, later, previous)
    assert result.fail_static is True
    assert {a: e.weight for a, e in result.endpoints.items()} == {"a:1": 100, "b:1": 60, "c:1": 1}
    assert all(e.stale and e.reason == "fail-static" for e in result.endpoints.values())
    # Held again on the next round, from the fail-static output itself.
    again = compute_pool_weights(pool, POLICY, later + 5.0, result)
    assert again == result


def test_one_fresh_endpoint_prevents_fail_static() -> None:
    previous = PoolWeights(
        endpoints={"a:1": EndpointWeight(90, False, False, {}, NOW)}, fail_static=False
    )
    pool = {"a:1": obs(0.0, age=60.0), "b:1": obs(50.0)}
    result = compute_pool_weights(pool, POLICY, NOW, previous)
    assert result.fail_static is False
    assert result.endpoints["a:1"].weight == 1
    assert result.endpoints["b:1"].weight == 75


def test_empty_pool() -> None:
    assert compute_pool_weights({}, POLICY, NOW, None) == PoolWeights({}, fail_static=False)


def test_deterministic_and_sorted() -> None:
    pool = {"z:1": obs(30.0), "a:9": obs(None), "m:2": obs(70.0, error="http: status 500")}
    reordered = dict(reversed(list(pool.items())))
    first = compute_pool_weights(pool, POLICY, NOW, None)
    second = compute_pool_weights(reordered, POLICY, NOW, None)
    assert first == second
    assert list(first.endpoints) == ["a:9", "m:2", "z:1"]
    assert list(second.endpoints) == ["a:9", "m:2", "z:1"]


@given(
    pcts_by_endpoint=st.dictionaries(
        st.from_regex(r"10\.0\.0\.[0-9]{1,3}:8000", fullmatch=True), pcts, max_size=8
    ),
    ages=st.lists(st.floats(min_value=0.0, max_value=20.0), min_size=8, max_size=8),
)
def test_weights_always_valid(pcts_by_endpoint: dict[str, float], ages: list[float]) -> None:
    pool = {a: obs(p, age=ages[i]) for i, (a, p) in enumerate(pcts_by_endpoint.items())}
    result = compute_pool_weights(pool, POLICY, NOW, None)
    assert set(result.endpoints) == set(pool)
    assert all(1 <= e.weight <= 100 for e in result.endpoints.values())
    assert result == compute_pool_weights(pool, POLICY, NOW, None)


# --- warm-up and flagged inputs (weight_calculator.adjust) -------------------------------


def _pool(*addresses: str) -> PoolWeights:
    return compute_pool_weights({a: obs(40.0) for a in addresses}, POLICY, NOW, None)


def test_warm_up_lasts_only_the_window_after_first_seen() -> None:
    weights = compute_pool_weights(
        {"a:1": obs(40.0), "b:1": obs(None, error="connect: refused")}, POLICY, NOW, None
    )
    young = {"a:1": obs(40.0), "b:1": Observation(None, "connect: refused", first_seen=NOW - 6)}
    warmed = warm_up(weights, young, 10, 6.0, NOW)
    assert warmed.endpoints["b:1"].weight == 10 and warmed.endpoints["b:1"].health == WARMING
    assert not warmed.endpoints["b:1"].saturated
    assert warmed.endpoints["a:1"] == weights.endpoints["a:1"]
    old = {**young, "b:1": Observation(None, "connect: refused", first_seen=NOW - 6.5)}
    assert warm_up(weights, old, 10, 6.0, NOW).endpoints["b:1"].weight == 1
    unknown = {**young, "b:1": Observation(None, "connect: refused")}
    assert warm_up(weights, unknown, 10, 6.0, NOW).endpoints["b:1"].weight == 1


def test_warm_up_leaves_a_fail_static_pool_alone() -> None:
    held = PoolWeights({"a:1": dataclasses.replace(_pool("a:1").endpoints["a:1"], weight=33)},
                       fail_static=True)
    young = {"a:1": Observation(None, None, first_seen=NOW)}
    assert warm_up(held, young, 10, 6.0, NOW) is held


def test_without_warm_up_drops_only_warm_up_weights() -> None:
    pool = _pool("a:1", "b:1")
    warm = dataclasses.replace(pool.endpoints["b:1"], weight=10, health=WARMING)
    previous = PoolWeights({"a:1": pool.endpoints["a:1"], "b:1": warm}, fail_static=False)
    assert set(without_warm_up(previous).endpoints) == {"a:1"}  # type: ignore[union-attr]
    assert without_warm_up(pool) is pool and without_warm_up(None) is None


def test_flag_problems_copies_sample_problems_into_weight_and_reason() -> None:
    bad = Sample(NOW - 1, {"gpu_mem_pct": 40.0}, problems=("gpu_util_pct: is nan",))
    observations = {"a:1": Observation(bad), "b:1": obs(40.0)}
    flagged = flag_problems(compute_pool_weights(observations, POLICY, NOW, None), observations)
    assert flagged.endpoints["a:1"].problems == ("gpu_util_pct: is nan",)
    assert flagged.endpoints["a:1"].reason == "ok; input problems: gpu_util_pct: is nan"
    assert flagged.endpoints["a:1"].weight == 80 and flagged.endpoints["b:1"].problems == ()
    clean = compute_pool_weights({"b:1": obs(40.0)}, POLICY, NOW, None)
    assert flag_problems(clean, {"b:1": obs(40.0)}) is clean
