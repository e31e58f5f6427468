"""Canary rollouts driven by the controller: SLO telemetry in, RDS splits and a state file out."""

from __future__ import annotations

import asyncio

from envoy.config.route.v3.route_pb2 import RouteConfiguration

from xds_server import type_urls as T
from xds_server.cache import SnapshotCache
from xds_server.config import parse_config
from xds_server.controller import Controller
from xds_server.rollout import PROGRESSING, ROLLED_BACK, load_state
from xds_server.telemetry import ScrapeResult

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


def page(requests: float, fast: float) -> dict[str, float]:
    """SLO keys as parse_slo produces them: `fast` of `requests` had TTFT under 0.1 s."""
    return {"gpu_mem_pct": 10.0, "slo:requests": requests, "slo:ttft:0.1": fast,
            "slo:ttft:1.0": requests, "slo:ttft:+Inf": requests}


class Feed:
    def __init__(self) -> None:
        self.pages: dict[str, dict[str, float]] = {}

    async def scrape(self, targets, now, parse=None):
        return {a: ScrapeResult(dict(self.pages[a]), None, now()) for a in targets}

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
