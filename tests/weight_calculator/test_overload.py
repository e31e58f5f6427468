"""Sustained overload (weight_calculator/overload.py): detecting it from the pool's finished
requests and growing backlog, and the split that keeps every endpoint but the slowest tier at
its service rate instead of running every endpoint past its rate."""

from __future__ import annotations

import pytest

from weight_calculator.health import DEGRADED, HEALTHY, STANDBY
from weight_calculator.inputs import EndpointInput, Signals
from weight_calculator.overload import Excess, overload_split, pool_excess
from weight_calculator.queueing import QueueingPolicy, Reading, compute_queueing_weights

NOW = 1000.0
H100, L4 = 400_000.0, 40_000.0  # KV capacities: two tiers


def reads(tokens_per_s: float, done_per_s: float, held_from: float, held_to: float, *,
          kv: float, seconds: float = 20.0, step: float = 2.0) -> list[Reading]:
    """Reads every ``step`` s up to NOW; the requests held (half running, half waiting) go
    from ``held_from`` to ``held_to`` linearly."""
    n = int(seconds / step)
    out = []
    for i in range(n + 1):
        held = held_from + (held_to - held_from) * i / n
        out.append(Reading(NOW - seconds + i * step, done_per_s * i * step,
                           tokens_per_s * i * step, running=held / 2, waiting=held / 2,
                           kv_usage=kv))
    return out


def inp(capacity: float, kv: float, held: float) -> EndpointInput:
    return EndpointInput(Signals(kv_usage=kv, queue=held / 2, running=held / 2,
                                 capacity=capacity), NOW - 0.5)


# --- detection --------------------------------------------------------------------------------


def test_a_backlog_growing_past_noise_and_past_a_windows_completions_is_overload() -> None:
    growing = {"a": reads(4000, 0.5, 50, 150, kv=0.5), "b": reads(800, 0.4, 50, 150, kv=0.99)}
    e = pool_excess(growing, ["a", "b"], NOW, 20.0)
    assert e is not None
    assert e.finished == pytest.approx(18.0) and e.growth == pytest.approx(200.0)
    assert e.held == pytest.approx(300.0) and e.span == pytest.approx(20.0)
    assert e.overloaded
    assert e.arrival_rate == pytest.approx(218.0 / 20.0)
    assert e.share == pytest.approx(200.0 / 218.0)


def test_steady_load_a_noisy_count_and_a_short_burst_are_not_overload() -> None:
    steady = {"a": reads(4000, 5.0, 40, 40, kv=0.5)}
    assert not pool_excess(steady, ["a"], NOW, 20.0).overloaded  # type: ignore[union-attr]
    # the count grew by less than Poisson noise in 100 arrivals explains (2 x 10)
    assert not Excess(finished=85.0, growth=15.0, held=120.0).overloaded
    # a burst: the backlog grew, but the pool finishes more than it holds within a window
    assert not Excess(finished=300.0, growth=60.0, held=90.0).overloaded
    assert pool_excess({}, ["a"], NOW, 20.0) is None  # no reads: nothing said


# --- the split --------------------------------------------------------------------------------


def test_one_tier_is_split_in_proportion_to_the_rates() -> None:
    mu = {"a": 3000.0, "b": 1000.0}
    split = overload_split(mu, {"a": "t", "b": "t"}, {"a": 10, "b": 3},
                           {"a": 60_000, "b": 20_000}, arrival_rate=5.0)
    assert split == pytest.approx({"a": 0.75, "b": 0.25})


def test_faster_tiers_get_their_rate_in_requests_and_the_slowest_tier_the_excess() -> None:
    mu = {"h0": 4000.0, "h1": 4000.0, "l0": 800.0, "l1": 800.0}
    tiers = {"h0": "h", "h1": "h", "l0": "l", "l1": "l"}
    # the H tier finished 20 requests for 160k tokens: 8k tokens per request, so its rate
    # is 1 request/s; 10 requests/s arrive
    split = overload_split(mu, tiers, {"h0": 10, "h1": 10, "l0": 8, "l1": 8},
                           {"h0": 80_000, "h1": 80_000, "l0": 16_000, "l1": 16_000},
                           arrival_rate=10.0)
    assert split["h0"] == pytest.approx(0.05) and split["h1"] == pytest.approx(0.05)
    assert split["l0"] == pytest.approx(0.45) and split["l1"] == pytest.approx(0.45)
    # never more than its share of the capacity, and a tier that computed nothing gets that
    light = overload_split(mu, tiers, {"h0": 100, "h1": 100}, {"h0": 1000, "h1": 1000},
                           arrival_rate=10.0)
    assert light["h0"] == pytest.approx(4000 / 9600)
    idle = overload_split(mu, tiers, {}, {}, arrival_rate=10.0)
    assert idle["h0"] == pytest.approx(4000 / 9600)


# --- the policy -------------------------------------------------------------------------------


def _pool(growing: bool) -> tuple[dict[str, EndpointInput], dict[str, list[Reading]]]:
    end = 150.0 if growing else 50.0
    inputs = {"h0": inp(H100, 0.5, end), "h1": inp(H100, 0.5, end),
              "l0": inp(L4, 0.99, end), "l1": inp(L4, 0.99, end)}
    readings = {"h0": reads(4000, 0.5, 50, end, kv=0.5), "h1": reads(4000, 0.5, 50, end, kv=0.5),
                "l0": reads(800, 0.4, 50, end, kv=0.99), "l1": reads(800, 0.4, 50, end, kv=0.99)}
    return inputs, readings


def test_an_overloaded_pool_keeps_fast_tiers_at_their_rate_and_idles_no_endpoint() -> None:
    """Every endpoint queued and the pool's backlog growing (2.4x overload): the fast tier
    (8k tokens of work per finished request: 1 request/s) gets ~1 request/s of the ~21.8
    arriving, the slow tier the rest; its full KV caches are load, not DEGRADED, and nothing
    is on standby. Before, the split followed the token rates (the H tier ~83 %) and the
    full L4s were DEGRADED, so the H100s took nearly everything and ran far past their
    rate."""
    inputs, readings = _pool(growing=True)
    w = compute_queueing_weights(inputs, readings, QueueingPolicy(), NOW, None)
    assert {ew.health for ew in w.endpoints.values()} == {HEALTHY}
    h_tier, l_tier = w.endpoints["h0"].locality or "", w.endpoints["l0"].locality or ""
    assert h_tier != l_tier
    assert w.localities[l_tier] > 10 * w.localities[h_tier]
    assert w.endpoints["h0"].breakdown["pool_excess_share"] == pytest.approx(400 / 436)


def test_the_same_pool_at_steady_load_is_weighed_as_before() -> None:
    inputs, readings = _pool(growing=False)
    w = compute_queueing_weights(inputs, readings, QueueingPolicy(), NOW, None)
    assert "pool_excess_share" not in w.endpoints["h0"].breakdown
    assert w.endpoints["h0"].health == HEALTHY
    assert w.endpoints["l0"].health in (DEGRADED, STANDBY)  # a full KV cache, the H100s not
    assert w.localities[w.endpoints["h0"].locality or ""] == 100
