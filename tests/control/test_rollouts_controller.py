"""Canary rollouts driven by the controller: SLO telemetry in, RDS splits and a state file out."""

from __future__ import annotations

import asyncio
import logging
import math

from envoy.config.route.v3.route_pb2 import RouteConfiguration
from prometheus_client import REGISTRY

from xds_server.config.load import parse_config
from xds_server.config.schema import RolloutsConfig
from xds_server.control.controller import Controller
from xds_server.control.rollouts.machine import (
    HISTORY_LIMIT,
    PROGRESSING,
    PROMOTED,
    ROLLED_BACK,
    VersionStats,
    load_state,
)
from xds_server.control.rollouts.runner import Rollouts
from xds_server.telemetry.reading import SloCounters
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

STABLE, CANARY = "10.0.0.1:80", "10.0.0.2:80"


def config(state_file):
    return parse_config({
        "rollouts": {"state_file": str(state_file)},
        "pools": [{"name": "p", "model": "m",
                   "versions": {"stable": {"endpoints": [{"address": STABLE}]},
                                "canary": {"endpoints": [{"address": CANARY}]}},
                   "rollout": {"start_percent": 10, "step_percent": 10,
                               "step_interval_seconds": 10, "max_percent": 30,
                               "gates": {"min_requests": 5}}}]})


def page(requests: float, fast: float) -> SloCounters:
    """What the page parser reads for the gates: `fast` of `requests` had TTFT under 0.1 s."""
    return SloCounters(ttft={0.1: fast, 1.0: requests, math.inf: requests}, requests=requests)


class Feed:
    def __init__(self) -> None:
        self.pages: dict[str, SloCounters] = {}

    async def scrape(self, targets, now, parse=None):
        return {a: ScrapeResult({"gpu_mem_pct": 10.0}, None, now(), slo=self.pages[a])
                for a in targets}

    async def close(self) -> None:
        pass


def split(cache: SnapshotCache) -> dict[str, int]:
    routes: RouteConfiguration = cache.snapshot.of_type(T.ROUTE)["trimtab-routes"].message
    action = next(r.route for r in routes.virtual_hosts[0].routes if r.name == "body:p")
    if action.cluster:
        return {action.cluster: 1000}
    return {c.name: c.weight.value for c in action.weighted_clusters.clusters}


def test_rollout_steps_rolls_back_and_resumes_from_the_state_file(tmp_path):
    state_file = tmp_path / "rollouts.json"
    clock = [0.0]
    feed = Feed()
    feed.pages = {STABLE: page(0, 0), CANARY: page(0, 0)}
    cache = SnapshotCache()
    controller = Controller(config(state_file), cache, scraper=feed, clock=lambda: clock[0],
                            state_file=state_file)
    asyncio.run(controller.tick())
    assert split(cache) == {"p": 900, "p-canary": 100}
    clock[0] = 10.0
    feed.pages = {STABLE: page(100, 95), CANARY: page(100, 95)}
    asyncio.run(controller.tick())
    assert controller.rollouts.states["p"].percent == 20
    assert split(cache) == {"p": 800, "p-canary": 200}
    assert load_state(state_file)["p"].percent == 20

    resumed = Controller(config(state_file), SnapshotCache(), scraper=feed,
                         clock=lambda: clock[0], state_file=state_file)
    assert resumed.rollouts.states["p"].percent == 20
    assert resumed.rollouts.states["p"].phase == PROGRESSING

    clock[0] = 12.0
    feed.pages = {STABLE: page(200, 190), CANARY: page(200, 100)}  # canary TTFT got slow
    asyncio.run(controller.tick())
    state = controller.rollouts.states["p"]
    assert state.phase == ROLLED_BACK and "TTFT" in state.reason
    assert split(cache) == {"p": 1000}
    assert load_state(state_file)["p"].phase == ROLLED_BACK


class GoodTracker:
    """Both versions healthy and busy: every gate passes at every tick."""

    def stats(self, addresses, since):
        return VersionStats(requests=100, ttft_p95_s=0.1, itl_p95_s=0.01)


def _events_total(pool: str, kind: str) -> float:
    value = REGISTRY.get_sample_value("trimtab_rollout_events_total",
                                      {"pool": pool, "kind": kind})
    return value or 0.0


def test_events_past_the_history_limit_are_still_logged_and_counted(tmp_path, caplog):
    """1 % steps: 99 steps plus start, pause, resume and promote, past the 50-event history."""
    config = parse_config({"pools": [{
        "name": "long", "model": "m",
        "versions": {"stable": {"endpoints": [{"address": STABLE}]},
                     "canary": {"endpoints": [{"address": CANARY}]}},
        "rollout": {"start_percent": 1, "step_percent": 1, "step_interval_seconds": 1,
                    "max_percent": 100, "gates": {"min_requests": 5}}}]})
    kinds = ("start", "step", "pause", "resume", "promote")
    before = {kind: _events_total("long", kind) for kind in kinds}
    rollouts = Rollouts(config, tmp_path / "rollouts.json")
    caplog.set_level(logging.INFO, logger="trimtab.rollout")
    for tick in range(300):
        rollouts.tick(GoodTracker(), float(tick))
        if tick == 70:  # operator commands once the history is full count too
            rollouts.command("long", "pause", 70.5)
            rollouts.command("long", "resume", 70.5)
        if rollouts.states["long"].phase == PROMOTED:
            break
    state = rollouts.states["long"]
    assert state.phase == PROMOTED and len(state.history) == HISTORY_LIMIT and state.seq == 103
    counted = {kind: _events_total("long", kind) - before[kind] for kind in kinds}
    assert counted == {"start": 1, "step": 99, "pause": 1, "resume": 1, "promote": 1}
    logged = [r.getMessage() for r in caplog.records if r.name == "trimtab.rollout"]
    assert sum(m.startswith("rollout long: step at") for m in logged) == 99
    assert logged[-1].startswith("rollout long: promote at 100%")
    assert load_state(tmp_path / "rollouts.json")["long"].seq == 103


def test_a_follower_keeps_its_state_when_the_file_turns_corrupt(tmp_path, caplog):
    state_file = tmp_path / "rollouts.json"
    driver = Rollouts(config(state_file), state_file)
    driver.tick(GoodTracker(), 0.0)
    follower_config = config(state_file).model_copy(
        update={"rollouts": RolloutsConfig(state_file=str(state_file), drive=False)})
    follower = Rollouts(follower_config, state_file)
    assert follower.states["p"].percent == 10
    good = state_file.read_text()
    state_file.write_text(good.replace('"percent": 10.0', '"percent": "10"'))
    assert state_file.read_text() != good
    assert follower.tick(GoodTracker(), 1.0) is False  # logged, not raised
    assert follower.states["p"].percent == 10
    assert "rollouts.p.percent: expected a finite number in 0..100, got '10'" in caplog.text
