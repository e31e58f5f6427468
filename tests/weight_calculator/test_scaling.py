"""The dual-metric autoscaler (pure): score formula, decisions, and property tests."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_calculator.scaling import (
    ScalingInputs,
    ScalingPolicy,
    ScalingState,
    compute_score,
    decide,
    decide_from_score,
    initial_state,
)

SEED = ScalingPolicy(latency_slo_seconds=2.0, min_replicas=1, max_replicas=5)


# -- score -------------------------------------------------------------------------------


def test_score_is_the_seed_formula():
    score = compute_score(ScalingInputs(p95_latency_seconds=1.0, memory_used_fraction=0.5), SEED)
    assert score == pytest.approx(0.6 * (1.0 / 2.0) + 0.4 * 0.5)


def test_latency_term_is_not_capped():
    score = compute_score(ScalingInputs(p95_latency_seconds=4.0, memory_used_fraction=0.0), SEED)
    assert score == pytest.approx(1.2)


@pytest.mark.parametrize("missing", [None, math.nan, math.inf])
def test_missing_latency_renormalises_to_memory(missing):
    inputs = ScalingInputs(p95_latency_seconds=missing, memory_used_fraction=0.7)
    assert compute_score(inputs, SEED) == pytest.approx(0.7)


def test_missing_memory_renormalises_to_latency():
    inputs = ScalingInputs(p95_latency_seconds=1.5, memory_used_fraction=None)
    assert compute_score(inputs, SEED) == pytest.approx(0.75)


def test_no_inputs_gives_no_score_and_holds():
    state = ScalingState(replicas=3)
    new, desired, reason = decide(state, ScalingInputs(), SEED, now=1000.0)
    assert compute_score(ScalingInputs(), SEED) is None
    assert (desired, new.replicas, new.last_scale_at) == (3, 3, None)
    assert "no telemetry" in reason


def test_memory_is_clamped_to_unit_interval():
    assert compute_score(ScalingInputs(memory_used_fraction=1.7), SEED) == pytest.approx(1.0)
    assert compute_score(ScalingInputs(memory_used_fraction=-0.2), SEED) == pytest.approx(0.0)


@pytest.mark.parametrize("kwargs", [
    {"latency_slo_seconds": 0}, {"min_replicas": 3, "max_replicas": 2},
    {"scale_down_threshold": 0.8, "scale_up_threshold": 0.8}, {"scale_up_step": 0},
    {"latency_weight": 0, "memory_weight": 0}, {"scale_up_cooldown_seconds": -1},
])
def test_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        ScalingPolicy(**kwargs)


# -- decisions ---------------------------------------------------------------------------


def test_thresholds_are_strict():
    state = ScalingState(replicas=3)
    assert decide_from_score(state, 0.8, SEED, 0.0).desired_replicas == 3
    assert decide_from_score(state, 0.3, SEED, 0.0).desired_replicas == 3
    assert decide_from_score(state, 0.81, SEED, 0.0).desired_replicas == 4
    assert decide_from_score(state, 0.29, SEED, 0.0).desired_replicas == 2


def test_scale_up_cooldown_boundary():
    state, desired, _ = decide_from_score(ScalingState(replicas=1), 0.9, SEED, now=100.0)
    assert (desired, state.last_scale_at, state.last_direction) == (2, 100.0, "up")
    held = decide_from_score(state, 0.9, SEED, now=159.9)
    assert held.desired_replicas == 2 and "cooldown" in held.reason
    assert held.state.last_scale_at == 100.0
    assert decide_from_score(state, 0.9, SEED, now=160.0).desired_replicas == 3


def test_scale_down_after_scale_up_waits_the_down_cooldown():
    state, _, _ = decide_from_score(ScalingState(replicas=2), 0.9, SEED, now=0.0)
    assert decide_from_score(state, 0.1, SEED, now=119.0).desired_replicas == 3
    assert decide_from_score(state, 0.1, SEED, now=120.0).desired_replicas == 2


def test_bounds_hold_and_say_so():
    at_max = decide_from_score(ScalingState(replicas=5), 5.0, SEED, 0.0)
    assert at_max.desired_replicas == 5 and "max_replicas" in at_max.reason
    at_min = decide_from_score(ScalingState(replicas=1), 0.0, SEED, 0.0)
    assert at_min.desired_replicas == 1 and "min_replicas" in at_min.reason


def test_out_of_bounds_state_is_clamped_despite_cooldown():
    state = ScalingState(replicas=9, last_scale_at=99.0, last_direction="up")
    new, desired, reason = decide_from_score(state, 0.5, SEED, now=100.0)
    assert desired == 5 and new.replicas == 5 and new.last_scale_at == 100.0
    assert "clamped" in reason


def test_nan_score_holds():
    new, desired, reason = decide_from_score(ScalingState(replicas=2), math.nan, SEED, 0.0)
    assert desired == 2 and new.score is None and "no telemetry" in reason


def test_initial_state_is_clamped():
    assert initial_state(SEED).replicas == 1
    assert initial_state(SEED, replicas=42).replicas == 5


def test_steps_are_configurable():
    policy = ScalingPolicy(max_replicas=10, scale_up_step=3, scale_down_step=2)
    assert decide_from_score(ScalingState(replicas=4), 0.9, policy, 0.0).desired_replicas == 7
    assert decide_from_score(ScalingState(replicas=4), 0.1, policy, 0.0).desired_replicas == 2
    assert decide_from_score(ScalingState(replicas=9), 0.9, policy, 0.0).desired_replicas == 10


# -- properties --------------------------------------------------------------------------


@st.composite
def policies(draw) -> ScalingPolicy:
    low = draw(st.integers(0, 5))
    down = draw(st.floats(0.0, 0.9))
    return ScalingPolicy(
        latency_slo_seconds=draw(st.floats(0.01, 10.0)),
        min_replicas=low,
        max_replicas=low + draw(st.integers(0, 10)),
        scale_down_threshold=down,
        scale_up_threshold=down + draw(st.floats(0.01, 1.0)),
        scale_up_cooldown_seconds=draw(st.floats(0.0, 300.0)),
        scale_down_cooldown_seconds=draw(st.floats(0.0, 300.0)),
        scale_up_step=draw(st.integers(1, 3)),
        scale_down_step=draw(st.integers(1, 3)),
    )


_maybe = st.one_of(st.none(), st.just(math.nan), st.floats(0.0, 20.0))
inputs_st = st.builds(ScalingInputs, p95_latency_seconds=_maybe, memory_used_fraction=_maybe)
ticks = st.lists(st.tuples(st.floats(0.0, 200.0), inputs_st), min_size=1, max_size=60)


def _run(policy: ScalingPolicy, start: int, steps) -> list[tuple[float, ScalingState, int]]:
    state, now, trace = ScalingState(replicas=start), 0.0, []
    for dt, inputs in steps:
        now += dt
        state, desired, _ = decide(state, inputs, policy, now)
        assert desired == state.replicas
        trace.append((now, state, desired))
    return trace


@settings(max_examples=300, deadline=None)
@given(policy=policies(), start=st.integers(-5, 30), steps=ticks)
def test_never_outside_bounds(policy, start, steps):
    for _, _, desired in _run(policy, start, steps):
        assert policy.min_replicas <= desired <= policy.max_replicas


@settings(max_examples=300, deadline=None)
@given(policy=policies(), data=st.data(), steps=ticks)
def test_never_two_scale_events_inside_a_cooldown(policy, data, steps):
    start = data.draw(st.integers(policy.min_replicas, policy.max_replicas))
    previous, last_event = start, None
    for now, state, desired in _run(policy, start, steps):
        if desired == previous:
            continue
        up = desired > previous
        assert state.last_direction == ("up" if up else "down") and state.last_scale_at == now
        if last_event is not None:
            cooldown = (policy.scale_up_cooldown_seconds if up
                        else policy.scale_down_cooldown_seconds)
            assert now - last_event >= cooldown
        previous, last_event = desired, now


@settings(max_examples=500, deadline=None)
@given(policy=policies(), replicas=st.integers(-2, 20),
       last=st.one_of(st.none(), st.floats(0.0, 500.0)), now=st.floats(0.0, 1000.0),
       a=st.floats(-1.0, 5.0), b=st.floats(-1.0, 5.0))
def test_monotone_in_score(policy, replicas, last, now, a, b):
    low, high = sorted((a, b))
    state = ScalingState(replicas=replicas, last_scale_at=last,
                         last_direction=None if last is None else "up")
    assert (decide_from_score(state, low, policy, now).desired_replicas
            <= decide_from_score(state, high, policy, now).desired_replicas)


@settings(max_examples=300, deadline=None)
@given(policy=policies(), lat=st.floats(0.0, 50.0), mem=st.floats(0.0, 1.0),
       bump=st.floats(0.0, 5.0))
def test_score_is_monotone_in_each_input(policy, lat, mem, bump):
    base = compute_score(ScalingInputs(lat, mem), policy)
    assert base is not None
    assert compute_score(ScalingInputs(lat + bump, mem), policy) >= base
    assert compute_score(ScalingInputs(lat, min(1.0, mem + bump)), policy) >= base
