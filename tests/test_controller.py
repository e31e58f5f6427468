"""The tick loop without I/O: a fake scraper feeds results; the real cache receives snapshots."""

from __future__ import annotations

import asyncio

from envoy.config.cluster.v3 import cluster_pb2

from tests.xds_fixtures import cluster
from xds_server import type_urls as T
from xds_server.cache import SnapshotCache
from xds_server.config import parse_config
from xds_server.controller import Controller
from xds_server.telemetry import ScrapeResult

CONFIG = parse_config({
    "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
    "pools": [
        {"name": "p", "model": "m", "endpoints": [{"address": "10.0.0.1:80"},
                                                   {"address": "10.0.0.2:80"}]},
        {"name": "q", "model": "n", "endpoints": [{"address": "10.0.1.1:80"}]},
    ],
})


class FakeScraper:
    def __init__(self) -> None:
        self.pct: dict[str, float | None] = {}
        self.calls = 0

    async def scrape(self, targets, now, parse=None):
        self.calls += 1
        out = {}
        for address in targets:
            pct = self.pct.get(address)
            out[address] = (ScrapeResult({"gpu_mem_pct": pct}, None, now()) if pct is not None
                            else ScrapeResult(None, "connect: refused", now()))
        return out

    async def close(self) -> None:
        pass


def make(clock_start: float = 1000.0):
    clock = [clock_start]
    scraper = FakeScraper()
    cache = SnapshotCache()
    controller = Controller(CONFIG, cache, scraper=scraper, clock=lambda: clock[0])
    return controller, scraper, cache, clock


def eds_weights(cache: SnapshotCache, pool: str) -> dict[str, int]:
    cla = cache.snapshot.of_type(T.ENDPOINT)[pool].message
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            e.load_balancing_weight.value for e in cla.endpoints[0].lb_endpoints}


def test_tick_publishes_formula_weights():
    controller, scraper, cache, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    asyncio.run(controller.tick())
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 90, "10.0.0.2:80": 60}
    assert eds_weights(cache, "q") == {"10.0.1.1:80": 100}


def test_unchanged_weights_publish_nothing_and_changes_touch_one_cluster():
    controller, scraper, cache, clock = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    asyncio.run(controller.tick())
    generation = cache.generation
    before = dict(cache.snapshot.of_type(T.ENDPOINT))
    clock[0] += 1
    asyncio.run(controller.tick())
    assert cache.generation == generation  # same weights: no push
    scraper.pct["10.0.1.1:80"] = 50.0
    clock[0] += 1
    asyncio.run(controller.tick())
    after = cache.snapshot.of_type(T.ENDPOINT)
    assert cache.generation == generation + 1
    assert after["p"] is before["p"] and after["q"].version != before["q"].version


def test_stale_endpoint_saturates_after_the_limit_and_others_are_unaffected():
    controller, scraper, cache, clock = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 20.0, "10.0.1.1:80": 0.0}
    asyncio.run(controller.tick())
    scraper.pct["10.0.0.2:80"] = None
    clock[0] += 1
    asyncio.run(controller.tick())
    assert controller.weights["p"].endpoints["10.0.0.2:80"].stale
    assert eds_weights(cache, "p")["10.0.0.2:80"] == 90  # young: last good sample still used
    clock[0] += 5
    asyncio.run(controller.tick())
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 90, "10.0.0.2:80": 1}


def test_pool_with_all_telemetry_lost_is_fail_static():
    controller, scraper, cache, clock = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 60.0, "10.0.1.1:80": 0.0}
    asyncio.run(controller.tick())
    scraper.pct = {"10.0.1.1:80": 0.0}
    clock[0] += 10
    asyncio.run(controller.tick())
    assert controller.weights["p"].fail_static
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 90, "10.0.0.2:80": 70}
    assert not controller.weights["q"].fail_static


def test_inconsistent_snapshot_is_refused_and_last_good_stays():
    controller, scraper, cache, clock = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    asyncio.run(controller.tick())
    good = cache.snapshot

    def dangling(messages):
        messages[T.CLUSTER].append(cluster("ghost"))

    controller.mutators.append(dangling)
    scraper.pct["10.0.1.1:80"] = 90.0
    clock[0] += 1
    asyncio.run(controller.tick())
    assert cache.snapshot is good
    assert controller.stats.rejected == 1 and "ghost" in (controller.stats.last_error or "")
    controller.mutators.clear()
    clock[0] += 1
    asyncio.run(controller.tick())
    assert cache.snapshot is not good and eds_weights(cache, "q") == {"10.0.1.1:80": 55}


def test_clusters_follow_the_configured_lb_policy_and_merge_window():
    controller, scraper, cache, _ = make()
    scraper.pct = {"10.0.0.1:80": 1.0, "10.0.0.2:80": 1.0, "10.0.1.1:80": 1.0}
    asyncio.run(controller.tick())
    c = cache.snapshot.of_type(T.CLUSTER)["p"].message
    assert c.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    assert c.common_lb_config.update_merge_window.ToMilliseconds() == 0
    cla = cache.snapshot.of_type(T.ENDPOINT)["p"].message
    assert cla.endpoints[0].load_balancing_weight.value >= 1
    assert cla.endpoints[0].locality.zone
