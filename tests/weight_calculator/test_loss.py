"""Losing telemetry (weight_calculator/loss.py), alone and through the controller: staleness in
missed ticks, a pool-wide loss held at the weights from before it whatever the tick phase and
read latency, and a garbled load signal held, then counted as saturated."""

from __future__ import annotations

import asyncio
import random

import pytest

from weight_calculator.loss import hold_on_loss, on_tick_clock, pool_lost, tick_fresh
from weight_calculator.types import EndpointWeight, Observation, PoolWeights, Sample
from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

NOW = 1_700_000_000.0
INTERVAL, STALE_AFTER = 2.0, 6.0  # the defaults
ADDRESSES = ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")


# --- pure ------------------------------------------------------------------------------------


def test_tick_fresh_counts_missed_ticks_with_a_float_tolerance() -> None:
    assert tick_fresh(3, 2.0, 6.0) and not tick_fresh(4, 2.0, 6.0)
    assert tick_fresh(3, 0.1, 0.3)  # 3 * 0.1 is 0.30000000000000004


@pytest.mark.parametrize("now", [NOW, NOW + 0.1, 1e9 + 1 / 3, 12.345])
@pytest.mark.parametrize(("failures", "interval", "stale_after"),
                         [(3, 2.0, 6.0), (4, 2.0, 6.0), (3, 0.1, 0.3), (2, 0.5, 1.0)])
def test_restamped_sample_gives_the_policy_the_tick_decision(now: float, failures: int,
                                                              interval: float,
                                                              stale_after: float) -> None:
    """The policy's own test (``now - collected_at <= stale_after``) agrees with the count
    of missed ticks, to the float, whatever the read latency of the last good read."""
    read_at = now - failures * interval - 0.4 * interval  # slow: the wall age is over the mark
    obs = {"a": Observation(Sample(read_at, {"gpu_mem_pct": 1.0}), "timeout", None, failures)}
    stamped = on_tick_clock(obs, interval, stale_after, now)["a"].sample
    assert stamped is not None
    assert (now - stamped.collected_at <= stale_after) == tick_fresh(failures, interval,
                                                                      stale_after)


def test_a_sample_overdue_on_the_wall_clock_is_left_alone() -> None:
    """Few ticks ran (a slow loop) but the sample is older than stale_after + interval."""
    obs = {"a": Observation(Sample(NOW - 9.0, {"gpu_mem_pct": 1.0}), "timeout", None, 1)}
    assert on_tick_clock(obs, INTERVAL, STALE_AFTER, NOW) == obs


def _ew(weight: int, health: str = "HEALTHY") -> EndpointWeight:
    return EndpointWeight(weight, False, False, {}, NOW, "ok", health)


def test_pool_lost_needs_every_latest_read_failed_and_some_telemetry_before() -> None:
    good = Observation(Sample(NOW, {}), None, NOW)
    failed = Observation(Sample(NOW, {}), "timeout", NOW, 1)
    never = Observation(None, "connect: refused", NOW, 3)
    assert pool_lost({"a": failed, "b": never})
    assert not pool_lost({"a": failed, "b": good})
    assert not pool_lost({"a": never, "b": never})  # nothing was lost: no telemetry ever
    assert not pool_lost({})


def test_hold_on_loss_keeps_previous_weights_and_degraded_health() -> None:
    computed = PoolWeights({"a": _ew(1), "b": _ew(1), "c": _ew(1)}, False)
    previous = PoolWeights({"a": _ew(80), "b": _ew(1, "DEGRADED")}, False)
    lost = {k: Observation(Sample(NOW, {}), "timeout", NOW, 1) for k in "abc"}
    held = hold_on_loss(computed, lost, previous)
    assert held.fail_static
    assert {k: (ew.weight, ew.health) for k, ew in held.endpoints.items()} == {
        "a": (80, "STALE"), "b": (1, "DEGRADED"), "c": (1, "STALE")}
    assert all(ew.stale and ew.reason.startswith("fail-static") for ew in held.endpoints.values())
    assert "holding weight 80 from before the loss" in held.endpoints["a"].reason


def test_hold_on_loss_keeps_the_localities_of_before_the_loss() -> None:
    from dataclasses import replace

    computed = PoolWeights({"a": replace(_ew(1), locality="unknown")}, False,
                           localities={"unknown": 1})
    previous = PoolWeights({"a": replace(_ew(80), locality="kv400000")}, False,
                           localities={"kv400000": 100, "kv100000": 9})
    lost = {"a": Observation(Sample(NOW, {}), "timeout", NOW, 1)}
    held = hold_on_loss(computed, lost, previous)
    assert held.localities == previous.localities
    assert held.endpoints["a"].locality == "kv400000"


# --- through the controller: the loss at 50 tick phases -------------------------------------


def _config(policy: str):
    return parse_config({
        "weights": {"policy": policy},
        "pools": [{"name": "p", "model": "m", "endpoints": [{"address": a} for a in ADDRESSES]}],
    })


SIGNALS = {
    "gpu_memory": {ADDRESSES[0]: {"gpu_mem_pct": 20.0}, ADDRESSES[1]: {"gpu_mem_pct": 60.0},
                   ADDRESSES[2]: {"gpu_mem_pct": 90.0}},
    "composite": {ADDRESSES[0]: {"kv_usage": 0.2, "queue": 1.0},
                  ADDRESSES[1]: {"kv_usage": 0.5, "queue": 4.0},
                  ADDRESSES[2]: {"kv_usage": 0.8, "queue": 9.0}},
}


class LossyFleet:
    """Each endpoint is read at the tick's start plus its own latency; a read that starts at
    or after its endpoint's ``lost_at`` fails (a dead Prometheus, a garbled page, a hang)."""

    def __init__(self, signals: dict[str, dict[str, float]], rng: random.Random) -> None:
        self.signals = signals
        self.rng = rng
        self.lost_at: dict[str, float] = {}
        self.tick_start = NOW

    def failing(self, address: str, read_at: float) -> bool:
        return read_at >= self.lost_at.get(address, float("inf"))

    async def scrape(self, targets, now, parse=None):
        out = {}
        for address in targets:
            read_at = self.tick_start + self.rng.uniform(0.001, 0.4)
            if self.failing(address, read_at):
                error = self.rng.choice(["parse: not a Prometheus text page", "http: status 500",
                                         "timeout: no complete answer within 1.6s"])
                out[address] = ScrapeResult(None, error, read_at)
            else:
                out[address] = ScrapeResult(dict(self.signals[address]), None, read_at)
        return out

    async def close(self) -> None:
        pass


def _eds(cache: SnapshotCache) -> dict[str, int]:
    cla = cache.snapshot.of_type(T.ENDPOINT)["p"].message
    return {f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}": e.load_balancing_weight.value
            for e in cla.endpoints[0].lb_endpoints}


def _run_loss(policy: str, lost_at: dict[str, float] | float, seed: int,
              ticks_after: int = 8) -> list[tuple[dict[str, int], bool]]:
    """Ticks on the default schedule (2 s, a few ms of scheduling jitter; ``now`` is read
    after the collect); the loss at ``lost_at`` (offset from the first tick after the
    warm-up). Returns (EDS weights, fail_static) after every tick, warm-up ticks first."""
    rng = random.Random(seed)
    fleet = LossyFleet(SIGNALS[policy], rng)
    clock = [NOW]
    cache = SnapshotCache()
    controller = Controller(_config(policy), cache, scraper=fleet, clock=lambda: clock[0])
    warm_ticks = 6
    loss_base = NOW + warm_ticks * INTERVAL
    offsets = lost_at if isinstance(lost_at, dict) else dict.fromkeys(ADDRESSES, lost_at)
    fleet.lost_at = {a: loss_base + offset for a, offset in offsets.items()}
    seen = []
    for k in range(warm_ticks + ticks_after):
        fleet.tick_start = NOW + k * INTERVAL + rng.uniform(0.0, 0.02)
        clock[0] = fleet.tick_start + rng.uniform(0.41, 1.7)  # after the slowest read
        asyncio.run(controller.tick())
        seen.append((_eds(cache), controller.weights["p"].fail_static))
    return seen


@pytest.mark.parametrize("policy", ["gpu_memory", "composite"])
def test_pool_wide_loss_at_any_tick_phase_holds_the_pre_loss_weights(policy: str) -> None:
    for phase in range(50):
        seen = _run_loss(policy, phase * INTERVAL / 50, seed=phase)
        before, _ = seen[5]
        assert not any(static for _, static in seen[:6])
        for tick, (weights, _) in enumerate(seen[6:]):
            assert weights == before, (policy, phase, tick, weights, before)
        assert seen[-1][1], f"phase {phase}: not fail-static after the loss"
        assert all(static for _, static in seen[8:]), phase  # every read failed by then


@pytest.mark.parametrize("policy", ["gpu_memory", "composite"])
def test_losses_spread_over_the_stale_window_hold_the_pre_loss_weights(policy: str) -> None:
    """Endpoints that lose telemetry in different ticks, the last within stale_after of the
    first in ticks (3 x 2 s): none drops to 1 before the pool goes fail-static."""
    for seed in range(20):
        phase = seed * INTERVAL / 20
        spread = {ADDRESSES[0]: phase, ADDRESSES[1]: phase + INTERVAL,
                  ADDRESSES[2]: phase + 3 * INTERVAL - 0.5}
        seen = _run_loss(policy, spread, seed=seed)
        before, _ = seen[5]
        for tick, (weights, _) in enumerate(seen[6:]):
            assert weights == before, (policy, seed, tick, weights, before)
        assert seen[-1][1]


def test_one_endpoint_lost_alone_still_saturates_after_stale_after() -> None:
    seen = _run_loss("gpu_memory", {ADDRESSES[1]: 0.0}, seed=1)
    before, _ = seen[5]
    after = [weights[ADDRESSES[1]] for weights, _ in seen[6:]]
    # lost in the first tick after the warm-up: fresh for 3 missed ticks (6 s), then 1
    assert after[:3] == [before[ADDRESSES[1]]] * 3 and after[3:] == [1] * 5
    assert not any(static for _, static in seen)


# --- a garbled load signal -------------------------------------------------------------------

TWINS = parse_config({
    "weights": {"policy": "composite"},
    "pools": [{"name": "t", "model": "m", "endpoints": [{"address": "10.1.0.1:80"},
                                                         {"address": "10.1.0.2:80"}]}],
})
HEALTHY = {"kv_usage": 0.3, "queue": 2.0, "itl_ms": 20.0}


def _read(at: float, garbled: bool) -> ScrapeResult:
    if not garbled:
        return ScrapeResult(dict(HEALTHY), None, at)
    return ScrapeResult({"kv_usage": float("nan"), "queue": -5.0, "itl_ms": 20.0}, None, at)


def test_garbled_gauges_hold_their_last_good_value_then_weigh_at_most_half_the_twin() -> None:
    clock = [NOW]
    controller = Controller(TWINS, SnapshotCache(), scraper=LossyFleet({}, random.Random(0)),
                            clock=lambda: clock[0])
    twin, broken = "10.1.0.1:80", "10.1.0.2:80"
    controller.ingest({twin: _read(NOW, False), broken: _read(NOW, False)})
    healthy = controller.weights["t"].endpoints[twin].weight
    assert controller.weights["t"].endpoints[broken].weight == healthy
    history = []
    for step in range(1, 8):  # NaN KV and a queue of -5 from now on
        clock[0] = NOW + 2 * step
        controller.ingest({twin: _read(clock[0], False), broken: _read(clock[0], True)})
        history.append(controller.weights["t"].endpoints[broken])
    held, saturated = history[:3], history[3:]  # held for 6 s (stale_after), then saturated
    assert all(ew.weight == healthy and ew.signals["kv_usage"] == 0.3 for ew in held)
    assert all(any("holding the last good value" in p for p in ew.problems) for ew in held)
    for ew in saturated:
        assert 2 * ew.weight <= controller.weights["t"].endpoints[twin].weight, ew
        assert ew.signals["kv_usage"] == 1.0 and ew.signals["queue"] == 32.0
        assert any("counted as saturated" in p for p in ew.problems)
        assert "nan" in ew.problems[0] and "input problems" in ew.reason  # flagged as before
    clock[0] += 2
    controller.ingest({twin: _read(clock[0], False), broken: _read(clock[0], False)})
    back = controller.weights["t"].endpoints[broken]
    assert back.problems == () and back.signals["kv_usage"] == 0.3  # valid again


def test_a_signal_the_server_never_reports_is_renormalised_not_saturated() -> None:
    """TGI has no KV gauge: no problem line, so the mix renormalises over what is there."""
    controller = Controller(TWINS, SnapshotCache(), scraper=LossyFleet({}, random.Random(0)),
                            clock=lambda: NOW)
    controller.ingest({"10.1.0.1:80": ScrapeResult({"queue": 2.0}, None, NOW),
                       "10.1.0.2:80": ScrapeResult({"queue": 2.0, "kv_usage": 0.0}, None, NOW)})
    tgi = controller.weights["t"].endpoints["10.1.0.1:80"]
    assert tgi.problems == () and "kv_usage" not in tgi.signals and tgi.weight > 50


# --- coming out of a pool-wide loss ----------------------------------------------------------


class RecoveringFleet(LossyFleet):
    """As LossyFleet; a read that starts at or after its endpoint's ``back_at`` works again."""

    def __init__(self, signals, rng) -> None:
        super().__init__(signals, rng)
        self.back_at: dict[str, float] = {}

    def failing(self, address: str, read_at: float) -> bool:
        return super().failing(address, read_at) and \
            read_at < self.back_at.get(address, float("inf"))


def _run_recovery(back: dict[str, float], seed: int, ticks: int = 22
                  ) -> list[tuple[dict[str, int], bool]]:
    rng = random.Random(seed)
    fleet = RecoveringFleet(SIGNALS["gpu_memory"], rng)
    clock = [NOW]
    cache = SnapshotCache()
    controller = Controller(_config("gpu_memory"), cache, scraper=fleet, clock=lambda: clock[0])
    loss = NOW + 6 * INTERVAL + 0.3
    fleet.lost_at = dict.fromkeys(ADDRESSES, loss)
    fleet.back_at = {a: loss + offset for a, offset in back.items()}
    seen = []
    for k in range(ticks):
        fleet.tick_start = NOW + k * INTERVAL + rng.uniform(0.0, 0.02)
        clock[0] = fleet.tick_start + rng.uniform(0.41, 1.7)
        asyncio.run(controller.tick())
        seen.append((_eds(cache), controller.weights["p"].fail_static))
    return seen


def test_endpoints_back_a_tick_after_the_others_keep_their_weight() -> None:
    """Telemetry returns at one instant, which falls between the reads of one tick: the
    endpoints read before it still fail in that tick, long past stale_after on the wall
    clock, and must not drop to 1 while the pool is no longer fail-static."""
    for seed in range(20):
        back = 10 * INTERVAL + seed * INTERVAL / 20  # 20 s of loss, any phase
        seen = _run_recovery(dict.fromkeys(ADDRESSES, back), seed)
        before, _ = seen[5]
        assert all(weights == before for weights, _ in seen[6:]), (seed, seen)
        assert not seen[-1][1] and any(static for _, static in seen)


def test_an_endpoint_that_never_comes_back_goes_stale_after_the_pool_recovered() -> None:
    back = {ADDRESSES[0]: 10 * INTERVAL, ADDRESSES[1]: 10 * INTERVAL}  # the third stays lost
    seen = _run_recovery(back, seed=3, ticks=24)
    before, _ = seen[5]
    recovered = next(i for i, (_, static) in enumerate(seen) if i > 6 and not static)
    third = [weights[ADDRESSES[2]] for weights, _ in seen[recovered:]]
    # held for stale_after counted from the recovery (less a tick it may have lost before
    # the others), then saturated like any endpoint that lost its telemetry alone
    assert third[:2] == [before[ADDRESSES[2]]] * 2 and set(third[4:]) == {1}, third
