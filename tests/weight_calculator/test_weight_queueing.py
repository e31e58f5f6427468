"""The queueing policy: service rates from counters, predicted wait, the square-root split,
the relative deadband, bounds, staleness and fail-static."""

from __future__ import annotations

import math

import pytest

from weight_calculator.inputs import EndpointInput, Signals
from weight_calculator.queueing import (
    QueueingPolicy,
    Reading,
    compute_queueing_weights,
    rates,
    smooth,
    square_root_split,
)
from weight_calculator.types import EndpointWeight, PoolWeights

NOW = 1000.0
# Per-endpoint weights (round 2's semantics: one locality). The endpoints here share one KV
# capacity, so the default capacity tiers would pool them; tests/weight_calculator/
# test_weight_tiers.py covers the tiers. Utilisation "queued": only queued intervals
# measure the rate.
POLICY = QueueingPolicy(capacity_tiers=False)
KV = QueueingPolicy(utilisation="kv", capacity_tiers=False)  # unsaturated: by KV use
SQRT_KV = QueueingPolicy(utilisation="kv", split="square_root",
                         capacity_tiers=False)  # round 1's split


def history(tokens_per_s: float, *, waiting: float = 0.0, kv: float = 0.5, done_per_s: float = 1.0,
            seconds: float = 20.0, step: float = 2.0, end: float = NOW) -> list[Reading]:
    """Reads every ``step`` seconds up to ``end`` at a constant throughput."""
    n = int(seconds / step)
    start = end - n * step
    return [Reading(start + i * step, done_per_s * i * step, tokens_per_s * i * step,
                    running=4.0, waiting=waiting, kv_usage=kv) for i in range(n + 1)]


def inp(kv: float = 0.5, queue: float = 0.0, capacity: float = 100_000.0,
        at: float = NOW - 0.5, running: float = 0.0) -> EndpointInput:
    return EndpointInput(Signals(kv_usage=kv, queue=queue, running=running,
                                 capacity=capacity), at)


# --- rates ------------------------------------------------------------------------------------


def test_a_saturated_endpoints_throughput_is_its_service_rate() -> None:
    r = rates(history(600.0, waiting=5.0, kv=0.9), NOW, POLICY)
    assert r.throughput == pytest.approx(600.0)
    assert r.service_rate == pytest.approx(600.0)  # requests waited throughout: u = 1
    assert r.saturated_seconds == pytest.approx(20.0)


def test_an_unsaturated_endpoint_only_bounds_its_rate_from_below() -> None:
    r = rates(history(600.0, kv=0.25), NOW, POLICY)
    assert r.throughput == pytest.approx(600.0)
    assert r.service_rate is None  # never queued: no measurement at capacity
    assert r.saturated_seconds == 0.0
    # half the window queued: those intervals alone measure it
    mixed = history(600.0, kv=0.25, seconds=10.0, end=NOW - 10.0) + [
        Reading(NOW - 10.0 + 2.0 * i, 3.0 + i, 6000.0 + 900.0 * 2.0 * i, 4.0, 3.0, 0.9)
        for i in range(6)]
    assert rates(mixed, NOW, POLICY).service_rate == pytest.approx(900.0)


def test_in_kv_mode_an_unsaturated_rate_is_extrapolated_by_kv_use() -> None:
    r = rates(history(600.0, kv=0.25), NOW, KV)
    assert r.service_rate == pytest.approx(2400.0)  # at a quarter of its KV in use


def test_idle_intervals_and_counter_resets_say_nothing() -> None:
    idle = rates(history(0.0, kv=0.0), NOW, KV)
    assert idle.throughput == 0.0 and idle.service_rate is None
    before = history(600.0, waiting=5.0, kv=0.9, seconds=10.0, end=NOW - 10.0)
    after = history(600.0, waiting=5.0, kv=0.9, seconds=8.0)  # restarted: counters from 0
    r = rates(before + after, NOW, POLICY)
    # the interval across the restart (counters went backwards) is skipped
    assert r.service_rate == pytest.approx(600.0)
    assert r.throughput == pytest.approx(600.0)
    old = rates(history(600.0, end=NOW - 100.0), NOW, POLICY)  # outside the window
    assert old.throughput is None and old.service_rate is None


# --- the split --------------------------------------------------------------------------------


def test_square_root_split_loads_fast_servers_more_than_in_proportion() -> None:
    mu = {"h100": 9.6, "a100": 3.0, "l4": 0.47}
    split = square_root_split(mu, 8.0)
    assert sum(split.values()) == pytest.approx(8.0)
    assert split["l4"] == 0.0  # used only when the fast ones would otherwise queue
    assert split["h100"] / mu["h100"] > split["a100"] / mu["a100"]
    near_full = square_root_split(mu, 12.5)
    assert near_full["l4"] > 0 and sum(near_full.values()) == pytest.approx(12.5)
    assert square_root_split(mu, 20.0) == mu  # overloaded: in proportion to the rates


# --- weights ----------------------------------------------------------------------------------


def test_weights_follow_the_measured_service_rate_not_the_kv_capacity() -> None:
    # the "L4" has 8 % of the KV of the "H100" but only 5 % of its speed, and is queueing
    inputs = {"h": inp(kv=0.3, capacity=450_000.0), "l": inp(kv=0.9, queue=6, capacity=38_000.0)}
    readings = {"h": history(6000.0, kv=0.3, done_per_s=5.0),
                "l": history(300.0, waiting=6.0, kv=0.9, done_per_s=0.25)}
    w = compute_queueing_weights(inputs, readings, KV, NOW, None)
    h, low = w.endpoints["h"], w.endpoints["l"]
    assert h.weight == 100 and low.weight == 1
    assert h.breakdown["service_rate"] == pytest.approx(20_000.0)  # 6000 / 0.3
    # by default the unqueued "H100" is not measured: its rate is at least what it did
    # (6000), more than the L4's rate per KV token says (300 / 38k x 450k = 3553)
    plain = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert plain.endpoints["h"].weight == 100 and plain.endpoints["l"].weight == 1
    assert "service_rate" not in plain.endpoints["h"].breakdown
    assert plain.endpoints["l"].breakdown["service_rate"] == pytest.approx(300.0)
    assert low.breakdown["service_rate"] == pytest.approx(300.0)
    per_request = (6000.0 + 300.0) / 5.25
    assert low.breakdown["backlog"] == pytest.approx(6 * per_request)
    assert low.breakdown["predicted_wait_s"] == pytest.approx(6 * per_request / 300.0)
    assert low.health == "STANDBY" and "standby" in low.reason  # the split leaves it out
    kept = compute_queueing_weights(inputs, readings, QueueingPolicy(capacity_tiers=False, utilisation="kv",
                                                                     standby=False), NOW, None)
    assert kept.endpoints["l"].health == "HEALTHY" and kept.endpoints["l"].weight == 1
    assert "predicted wait" in kept.endpoints["l"].reason


def test_without_counters_weights_are_capacity_over_queue() -> None:
    inputs = {"a": inp(capacity=200_000.0), "b": inp(capacity=100_000.0),
              "c": inp(capacity=100_000.0, queue=1.0)}
    w = compute_queueing_weights(inputs, {}, POLICY, NOW, None)
    assert {a: e.weight for a, e in w.endpoints.items()} == {"a": 100, "b": 50, "c": 25}
    assert all("service_rate" not in e.breakdown for e in w.endpoints.values())


def test_an_endpoint_without_evidence_gets_the_pools_rate_per_kv_token() -> None:
    inputs = {"seen": inp(kv=0.9, capacity=100_000.0), "new": inp(kv=0.0, capacity=50_000.0)}
    readings = {"seen": history(1800.0, kv=0.9)}
    w = compute_queueing_weights(inputs, readings, KV, NOW, None)
    # seen: mu = 1800 / 0.9 = 2000 tokens/s; new: 2000 / 100k x 50k = 1000; lam = 1800 ->
    # equal spare (2000 + 1000 - 1800) / 2 = 600: r = 1400 and 400
    assert w.endpoints["new"].breakdown["service_rate_used"] == pytest.approx(1000.0)
    assert w.endpoints["new"].weight == round(100 * 400 / 1400)
    assert "service_rate" not in w.endpoints["new"].breakdown
    # the square-root rule on the same rates (round 1's default)
    sqrt = compute_queueing_weights(inputs, readings, SQRT_KV, NOW, None)
    mu_seen, mu_new, lam = 2000.0, 1000.0, 1800.0
    spare = (mu_seen + mu_new - lam) / (math.sqrt(mu_seen) + math.sqrt(mu_new))
    r_seen, r_new = mu_seen - math.sqrt(mu_seen) * spare, mu_new - math.sqrt(mu_new) * spare
    assert sqrt.endpoints["new"].weight == round(100 * r_new / r_seen)


def test_the_service_rate_is_remembered_through_previous_weights() -> None:
    inputs = {"a": inp(kv=0.9, queue=3.0), "b": inp(kv=0.2)}
    first = compute_queueing_weights(
        inputs, {"a": history(500.0, waiting=3.0, kv=0.9), "b": history(1000.0, kv=0.2)},
        KV, NOW, None)
    assert first.endpoints["a"].breakdown["service_rate"] == pytest.approx(500.0)
    # a quiet minute later: no readings in the window, the estimate is kept
    inputs = {"a": inp(kv=0.9, queue=3.0, at=NOW + 59), "b": inp(kv=0.2, at=NOW + 59)}
    later = compute_queueing_weights(inputs, {}, KV, NOW + 60, first)
    assert later.endpoints["a"].breakdown["service_rate"] == pytest.approx(500.0)
    # new evidence is blended with rate_alpha ...
    again = compute_queueing_weights(
        inputs, {"a": history(300.0, waiting=3.0, kv=0.9, end=NOW + 62)}, KV, NOW + 62,
        later)
    assert again.endpoints["a"].breakdown["service_rate"] == pytest.approx(400.0)
    # ... but never below what the endpoint was seen to do
    faster = compute_queueing_weights(
        inputs, {"a": history(1500.0, waiting=3.0, kv=0.9, end=NOW + 62)}, KV, NOW + 62,
        later)
    assert faster.endpoints["a"].breakdown["service_rate"] == pytest.approx(1500.0)
    # pure: the same arguments give the same weights
    assert compute_queueing_weights(inputs, {}, KV, NOW + 60, first) == later


def test_weights_stay_within_bounds() -> None:
    policy = QueueingPolicy(capacity_tiers=False, max_weight=7)
    inputs = {f"e{i}": inp(kv=0.99 if i == 0 else 0.1 * i, queue=1000.0 * (i % 2),
                           capacity=1000.0 * (i + 1)) for i in range(6)}
    readings = {a: history(100.0 * (i + 1), kv=0.5) for i, a in enumerate(inputs)}
    w = compute_queueing_weights(inputs, readings, policy, NOW, None)
    assert all(1 <= e.weight <= 7 for e in w.endpoints.values())
    assert w.endpoints["e0"].health == "DEGRADED" and w.endpoints["e0"].weight == 1
    assert w.endpoints["e1"].weight == 1  # a thousand waiting: the floor, never 0


# --- relative deadband and smoothing ----------------------------------------------------------


def test_relative_deadband_keeps_small_changes_and_drops_at_once() -> None:
    assert smooth(6, 6, POLICY) == 6
    assert smooth(95, 100, POLICY) == 100  # within 10 %: no rebuild of Envoy's balancer
    assert smooth(6, 5, POLICY) == 6  # +20 % on a small weight is not noise
    assert smooth(2, 6, POLICY) == 2  # a drop applies at once
    assert smooth(100, 20, POLICY) == 60  # a rise moves half the way
    assert smooth(30, None, POLICY) == 30


def test_an_overloaded_small_endpoint_loses_its_weight_within_one_tick() -> None:
    inputs = {"big": inp(kv=0.5, capacity=400_000.0), "small": inp(kv=0.5, capacity=40_000.0)}
    readings = {"big": history(4000.0, kv=0.5), "small": history(1000.0, kv=0.5)}
    # the square-root split keeps the small one in service (equal spare would put it on
    # standby at once: its 2000 tokens/s are below the 2500 of spare each would keep)
    calm = compute_queueing_weights(inputs, readings, SQRT_KV, NOW, None)
    assert calm.endpoints["small"].weight == 7  # r = 2000 - sqrt(2000) * 5000 / 134.2
    # next tick: the small one has ten requests waiting (25 000 tokens of work, 12 s at
    # its rate): its weight falls to the floor at once, not over several ticks
    tick = NOW + 2.0
    inputs = {"big": inp(kv=0.5, capacity=400_000.0, at=tick - 0.5),
              "small": inp(kv=0.9, queue=10.0, capacity=40_000.0, at=tick - 0.5)}
    readings = {"big": history(4000.0, kv=0.5, end=tick),
                "small": history(1000.0, kv=0.5, end=tick)}
    loaded = compute_queueing_weights(inputs, readings, SQRT_KV, tick, calm)
    assert loaded.endpoints["small"].weight == 1
    assert loaded.endpoints["small"].breakdown["predicted_wait_s"] > 10
    assert loaded.endpoints["big"].weight == 100


# --- staleness and fail-static ----------------------------------------------------------------


def test_stale_endpoints_are_saturated_and_a_lost_pool_is_fail_static() -> None:
    inputs = {"a": inp(), "b": inp(at=NOW - 60.0)}
    w = compute_queueing_weights(inputs, {"a": history(500.0)}, POLICY, NOW, None)
    assert w.endpoints["b"].weight == 1 and w.endpoints["b"].stale and not w.fail_static
    previous = PoolWeights({"a": EndpointWeight(40, False, False, {}, NOW),
                            "b": EndpointWeight(9, False, False, {}, NOW)}, False)
    lost = {"a": EndpointInput(None, None, "connection refused"), "b": inp(at=NOW - 60.0)}
    held = compute_queueing_weights(lost, {}, POLICY, NOW, previous)
    assert held.fail_static
    assert {a: e.weight for a, e in held.endpoints.items()} == {"a": 40, "b": 9}
    bad = compute_queueing_weights({"a": EndpointInput(Signals(kv_usage=math.nan), NOW)},
                                   {}, POLICY, NOW, None)
    assert bad.fail_static and bad.endpoints["a"].health == "INVALID"
    assert compute_queueing_weights({}, {}, POLICY, NOW, None) == PoolWeights({}, False)


def test_policy_knobs_are_checked() -> None:
    for bad in ({"deadband": 1.0}, {"rise_alpha": 0.0}, {"horizon_seconds": 0.0},
                {"max_weight": 0}, {"staleness": "nope"}):
        with pytest.raises(ValueError, match="QueueingPolicy"):
            QueueingPolicy(**bad)  # type: ignore[arg-type]


def test_the_proportional_split_is_available_by_name() -> None:
    inputs = {"a": inp(kv=0.5, capacity=400_000.0), "b": inp(kv=0.5, capacity=40_000.0)}
    readings = {"a": history(4000.0, kv=0.5), "b": history(1000.0, kv=0.5)}
    w = compute_queueing_weights(inputs, readings,
                                 QueueingPolicy(capacity_tiers=False, split="proportional", utilisation="kv"), NOW,
                                 None)
    assert {a: e.weight for a, e in w.endpoints.items()} == {"a": 100, "b": 25}  # 8000 : 2000
    with pytest.raises(ValueError, match="split"):
        QueueingPolicy(split="magic")


def test_in_flight_work_counts_half_a_request_each() -> None:
    """Round robin does not see active requests: an endpoint that piles up running requests
    must lose share before its KV cache fills (seen: 217 running at 99.5 % KV)."""
    readings = {"a": history(4000.0, kv=0.5), "b": history(4000.0, kv=0.5)}
    even = compute_queueing_weights({"a": inp(running=20.0), "b": inp(running=20.0)},
                                    readings, KV, NOW, None)
    assert even.endpoints["a"].weight == even.endpoints["b"].weight == 100
    piled = compute_queueing_weights({"a": inp(running=200.0), "b": inp(running=20.0)},
                                     readings, KV, NOW, None)
    a, b = piled.endpoints["a"], piled.endpoints["b"]
    per_request = 8000.0 / 2.0  # tokens per finished request over the window
    assert a.breakdown["backlog"] == pytest.approx(0.5 * 200.0 * per_request)
    assert a.breakdown["predicted_wait_s"] == pytest.approx(0.5 * 200.0 * per_request / 8000.0)
    assert b.weight == 100 and a.weight < b.weight / 4
    none = compute_queueing_weights({"a": inp(running=200.0), "b": inp(running=20.0)},
                                    readings, QueueingPolicy(capacity_tiers=False, utilisation="kv",
                                                             in_flight_share=0.0), NOW, None)
    assert none.endpoints["a"].weight == 100  # counting queued work only


def test_standby_never_takes_more_than_half_the_pool() -> None:
    inputs = {"h": inp(kv=0.5, capacity=400_000.0), "s1": inp(kv=0.5, capacity=10_000.0),
              "s2": inp(kv=0.5, capacity=10_000.0)}
    readings = {"h": history(2000.0, kv=0.5), "s1": history(50.0, kv=0.5),
                "s2": history(50.0, kv=0.5)}
    w = compute_queueing_weights(inputs, readings, KV, NOW, None)
    # the split leaves both small ones out, but two of three would be most of the pool: only
    # as many as half the pool go on standby (one of three), the smallest share first (ties
    # by address), the other keeps weight 1 (before round 2 none went on standby then)
    assert {a: e.health for a, e in w.endpoints.items()} == {
        "h": "HEALTHY", "s1": "STANDBY", "s2": "HEALTHY"}
    inputs["h2"] = inp(kv=0.5, capacity=400_000.0)
    readings["h2"] = history(2000.0, kv=0.5)
    w = compute_queueing_weights(inputs, readings, KV, NOW, None)
    assert [a for a, e in w.endpoints.items() if e.health == "STANDBY"] == ["s1", "s2"]
    assert all(e.weight == 1 for a, e in w.endpoints.items() if a.startswith("s"))


def test_a_pool_with_a_fallback_never_puts_enough_on_standby_to_spill() -> None:
    """Envoy spills an aggregate cluster's pool to its fallback once healthy hosts x 1.4 fall
    short of the pool: 2 of 4 on standby would send ~30 % of requests to the fallback model."""
    from weight_calculator.queueing import STANDBY_WITH_FALLBACK
    from xds_server.config.schema import Config
    from xds_server.control.weights import queueing_policy

    inputs = {"h1": inp(kv=0.5, capacity=400_000.0), "h2": inp(kv=0.5, capacity=400_000.0),
              "s1": inp(kv=0.5, capacity=10_000.0), "s2": inp(kv=0.5, capacity=10_000.0)}
    readings = {"h1": history(2000.0, kv=0.5), "h2": history(2000.0, kv=0.5),
                "s1": history(50.0, kv=0.5), "s2": history(50.0, kv=0.5)}
    alone = compute_queueing_weights(inputs, readings, KV, NOW, None)
    assert sorted(a for a, e in alone.endpoints.items() if e.health == "STANDBY") == ["s1", "s2"]
    guarded = QueueingPolicy(capacity_tiers=False, utilisation="kv", max_standby_share=STANDBY_WITH_FALLBACK)
    w = compute_queueing_weights(inputs, readings, guarded, NOW, None)
    healthy = sum(e.health == "HEALTHY" for e in w.endpoints.values())
    assert healthy * 1.4 >= len(inputs)  # Envoy's priority load stays 100 % on the pool
    config = Config.model_validate({"pools": [
        {"name": "big", "model": "m", "fallback": "small",
         "endpoints": [{"address": "127.0.0.1:8001"}]},
        {"name": "small", "model": "s", "endpoints": [{"address": "127.0.0.1:8002"}]}]})
    assert queueing_policy(config, config.pool("big")).max_standby_share == STANDBY_WITH_FALLBACK
    assert queueing_policy(config, config.pool("small")).max_standby_share == 0.5


# --- round 2: the tail split, Envoy's least_request divisor, engine-full, standby ----------


def test_equal_spare_split_leaves_every_used_endpoint_the_same_spare_rate() -> None:
    from weight_calculator.queueing import equal_spare_split

    mu = {"h": 10.0, "a": 3.0, "l": 0.5}
    split = equal_spare_split(mu, 9.0)
    # (10 + 3 - 9) / 2 = 2 spare each; the slow one (0.5 < that spare) is left out
    assert split == pytest.approx({"h": 8.0, "a": 1.0, "l": 0.0})
    assert sum(split.values()) == pytest.approx(9.0)
    # the square-root rule (mean-optimal) gives the slower endpoint more than this
    assert square_root_split(mu, 9.0)["a"] > split["a"]
    assert equal_spare_split(mu, 20.0) == mu  # overloaded: in proportion to the rates
    assert equal_spare_split({"x": 0.0, "y": 2.0}, 1.0) == {"x": 0.0, "y": 1.0}


def _twins(running: dict[str, float], bias: float) -> dict[str, int]:
    inputs = {a: inp(kv=0.3, running=n) for a, n in running.items()}
    readings = {a: history(5000.0, waiting=2.0, kv=0.3) for a in running}
    policy = QueueingPolicy(capacity_tiers=False, active_request_bias=bias, in_flight_share=0.0)
    w = compute_queueing_weights(inputs, readings, policy, NOW, None)
    return {a: e.weight for a, e in w.endpoints.items()}


def test_least_request_divisor_is_multiplied_into_the_weights() -> None:
    """Envoy's least_request picks by weight / (active + 1) ** bias: two equal endpoints with
    9 and 19 requests in flight need weights 10 : 20 for equal picks (round robin: 1 : 1)."""
    assert _twins({"a": 9.0, "b": 19.0}, bias=0.0) == {"a": 100, "b": 100}
    assert _twins({"a": 9.0, "b": 19.0}, bias=1.0) == {"a": 50, "b": 100}
    # without the divisor (for derived clusters, whose active counts are their own): equal
    inputs = {a: inp(kv=0.3, running=n) for a, n in (("a", 9.0), ("b", 19.0))}
    readings = {a: history(5000.0, waiting=2.0, kv=0.3) for a in inputs}
    w = compute_queueing_weights(inputs, readings, QueueingPolicy(capacity_tiers=False, active_request_bias=1.0,
                                                                  in_flight_share=0.0), NOW, None)
    assert {a: e.breakdown["share_weight"] for a, e in w.endpoints.items()} == {
        "a": 100.0, "b": 100.0}


def test_a_full_kv_cache_counts_as_saturated() -> None:
    full = [Reading(NOW - 20.0 + 2.0 * i, float(i), 800.0 * 2.0 * i, 8.0, 0.0, 0.97)
            for i in range(11)]
    r = rates(full, NOW, POLICY)
    assert r.service_rate == pytest.approx(800.0)  # no queue, but no room either
    half = [Reading(x.at, x.requests_done, x.tokens, 8.0, 0.0, 0.6) for x in full]
    assert rates(half, NOW, POLICY).service_rate is None


def test_a_share_below_one_weight_unit_is_standby_not_weight_one() -> None:
    inputs = {"h1": inp(capacity=400_000.0), "h2": inp(capacity=400_000.0),
              "s": inp(capacity=10_000.0, running=30.0, queue=10.0)}
    readings = {"h1": history(20_000.0, waiting=2.0), "h2": history(20_000.0, waiting=2.0),
                "s": history(300.0, waiting=10.0)}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    s = w.endpoints["s"]
    # its share after the wait discount is under 1/100 of the top one's: the floor (weight 1)
    # would send it more than that, so it gets no new requests instead
    assert s.breakdown["target_rate"] * 100 < w.endpoints["h1"].breakdown["target_rate"]
    assert (s.health, s.weight) == ("STANDBY", 1)


def test_a_pool_whose_every_kv_cache_is_full_is_loaded_not_degraded() -> None:
    inputs = {"a": inp(kv=0.97), "b": inp(kv=0.99)}
    readings = {a: history(5000.0, waiting=3.0, kv=0.98) for a in inputs}
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert {e.health for e in w.endpoints.values()} == {"HEALTHY"}
    inputs["c"] = inp(kv=0.5)
    readings["c"] = history(5000.0, waiting=3.0, kv=0.5)
    w = compute_queueing_weights(inputs, readings, POLICY, NOW, None)
    assert [a for a, e in w.endpoints.items() if e.health == "DEGRADED"] == ["a", "b"]


def test_the_divisor_uses_the_count_at_the_share_so_a_piled_up_twin_gets_less() -> None:
    """Two equal endpoints, one holding 100 requests and the other 20: multiplying by the
    counts seen gave the piled-up one the higher weight (100 : 90, measured as two H100s
    trading a 100-request pile); by Little's law it holds more than its share would, so its
    factor is scaled down by share / throughput and Envoy sends it less."""
    inputs = {"a": inp(kv=0.3, running=100.0), "b": inp(kv=0.3, running=20.0)}
    readings = {a: history(5000.0, waiting=2.0, kv=0.3) for a in inputs}
    w = compute_queueing_weights(inputs, readings, QueueingPolicy(capacity_tiers=False, active_request_bias=1.0),
                                 NOW, None)
    a, b = w.endpoints["a"], w.endpoints["b"]
    assert b.weight == 100 and a.weight < b.weight / 2
    # Envoy picks by weight / (active + 1): the piled-up one is picked far less
    assert a.weight / 101 < (b.weight / 21) / 4


def test_no_service_rate_is_reported_before_any_is_measured() -> None:
    """Before any endpoint is measured the split runs on relative KV capacity, which is not a
    rate: the prompt classes' prefill cap must not read it as tokens/s."""
    inputs = {"a": inp(capacity=400_000.0), "b": inp(capacity=40_000.0)}
    w = compute_queueing_weights(inputs, {}, POLICY, NOW, None)
    assert not any("service_rate_used" in e.breakdown for e in w.endpoints.values())
    assert w.endpoints["a"].weight == 100 and w.endpoints["b"].weight == 10
