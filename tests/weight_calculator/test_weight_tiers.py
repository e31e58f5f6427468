"""The queueing policy with capacity tiers (the default): pooled rates, localities, tier
standby, and what a tier without evidence does."""

from __future__ import annotations

import pytest

from weight_calculator.inputs import EndpointInput, Signals
from weight_calculator.queueing import QueueingPolicy, Reading, compute_queueing_weights
from weight_calculator.types import EndpointWeight, PoolWeights

NOW = 1000.0
POLICY = QueueingPolicy(active_request_bias=1.0)  # least_request, as a pool gets by default
BIG, SMALL = 400_000.0, 100_000.0


def history(tokens_per_s: float, *, waiting: float = 0.0, seconds: float = 20.0,
            step: float = 2.0) -> list[Reading]:
    n = int(seconds / step)
    start = NOW - n * step
    return [Reading(start + i * step, i * step, tokens_per_s * i * step, running=4.0,
                    waiting=waiting, kv_usage=0.5) for i in range(n + 1)]


def inp(capacity: float | None, queue: float = 0.0, kv: float = 0.5) -> EndpointInput:
    return EndpointInput(Signals(kv_usage=kv, queue=queue, running=4.0, capacity=capacity),
                         NOW - 0.5)


def test_twins_share_one_measured_rate_and_envoy_gets_one_locality_per_tier() -> None:
    inputs = {"h0": inp(BIG, queue=3.0), "h1": inp(BIG), "a0": inp(SMALL, queue=2.0),
              "a1": inp(SMALL)}
    readings = {"h0": history(20_000.0, waiting=3.0), "h1": history(5_000.0),
                "a0": history(6_000.0, waiting=2.0), "a1": history(1_000.0)}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    e = w.endpoints
    # h1 never queued, but its twin did: both are served at the tier's measured rate
    assert e["h0"].breakdown["service_rate"] == e["h1"].breakdown["service_rate"] == 20_000.0
    assert e["a1"].breakdown["service_rate"] == 6_000.0
    assert e["h0"].locality == e["h1"].locality == "kv400000"
    assert e["a0"].locality == "kv100000"
    assert {ew.weight for ew in e.values()} == {100}  # equal inside a tier: least_request
    assert w.localities["kv400000"] == 100 and 1 <= w.localities["kv100000"] < 100


def test_a_homogeneous_pool_is_one_locality_of_equal_weights() -> None:
    inputs = {a: inp(BIG, queue=q) for a, q in (("x", 0.0), ("y", 5.0), ("z", 1.0))}
    readings = {a: history(8_000.0, waiting=2.0) for a in inputs}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert {ew.weight for ew in w.endpoints.values()} == {100}
    assert dict(w.localities) == {"kv400000": 100}
    # under round robin each keeps its own share: the queued one less
    rr = compute_queueing_weights(inputs, readings, QueueingPolicy(), NOW, None)
    assert rr.endpoints["y"].weight < rr.endpoints["x"].weight == 100


def _previous(rates: dict[str, float], localities: dict[str, int]) -> PoolWeights:
    return PoolWeights({a: EndpointWeight(50, False, False, {}, NOW - 2.0,
                                          breakdown={"service_rate": r}, locality=loc)
                        for a, (r, loc) in rates.items()}, False, localities=localities)


def test_a_tier_without_evidence_drifts_up_to_its_capacity_prior() -> None:
    inputs = {"h": inp(BIG, queue=3.0), "a": inp(SMALL)}
    readings = {"h": history(20_000.0, waiting=3.0), "a": []}  # "a" got no traffic
    previous = _previous({"h": (20_000.0, "kv400000"), "a": (1_000.0, "kv100000")},
                         {"kv400000": 100, "kv100000": 1})
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, previous)
    prior = 20_000.0 / BIG * SMALL  # the measured tier's rate per KV token x its capacity
    relax = POLICY.horizon_seconds / POLICY.window_seconds
    assert w.endpoints["a"].breakdown["service_rate"] == pytest.approx(
        1_000.0 + relax * (prior - 1_000.0))
    # never down: an over-estimate corrects itself once the tier has traffic
    high = _previous({"h": (20_000.0, "kv400000"), "a": (9_000.0, "kv100000")}, {})
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, high)
    assert w.endpoints["a"].breakdown["service_rate"] == pytest.approx(9_000.0)


def test_a_slow_tier_goes_on_standby_whole_and_fail_static_keeps_the_localities() -> None:
    inputs = {"h0": inp(BIG, queue=1.0), "h1": inp(BIG), "l0": inp(SMALL), "l1": inp(SMALL)}
    readings = {"h0": history(20_000.0, waiting=1.0), "h1": history(4_000.0),
                "l0": history(300.0, waiting=2.0), "l1": history(100.0)}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert {a for a, ew in w.endpoints.items() if ew.health == "STANDBY"} == {"l0", "l1"}
    lost = {a: EndpointInput(None, None, "connect: refused") for a in inputs}
    held = compute_queueing_weights(lost, {}, POLICY, NOW + 100.0, w)
    assert held.fail_static and held.localities == w.localities
    assert {a: ew.locality for a, ew in held.endpoints.items()} == {
        a: ew.locality for a, ew in w.endpoints.items()}


def test_without_known_capacities_the_pool_is_one_unknown_tier() -> None:
    inputs = {"x": inp(None, queue=2.0), "y": inp(None)}
    readings = {"x": history(1_000.0, waiting=2.0), "y": history(500.0)}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert {ew.locality for ew in w.endpoints.values()} == {"unknown"}
    assert dict(w.localities) == {"unknown": 100}
    off = compute_queueing_weights(inputs, readings, QueueingPolicy(capacity_tiers=False),
                                   NOW, None)
    assert off.localities == {} and {ew.locality for ew in off.endpoints.values()} == {None}
