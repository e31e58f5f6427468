"""The tick loop: a fake scraper feeds results (or real pages over HTTP); the real cache
receives snapshots."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from dataclasses import replace

import pytest
from envoy.config.cluster.v3 import cluster_pb2
from prometheus_client import REGISTRY

from tests.support.backends import serve_pages
from tests.support.hooks import HookedController
from tests.support.wait import wait_until_async
from tests.support.xds_fixtures import cluster
from xds_server.config.load import parse_config
from xds_server.control import controller as controller_module
from xds_server.control.controller import Controller
from xds_server.telemetry.bounds import too_many_series
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

CONFIG = parse_config({
    "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
    "weights": {"policy": "gpu_memory"},  # these tests check the seed's formula end to end
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


def make(clock_start: float = 1000.0, controller_type: type[Controller] = Controller):
    clock = [clock_start]
    scraper = FakeScraper()
    cache = SnapshotCache()
    controller = controller_type(CONFIG, cache, scraper=scraper, clock=lambda: clock[0])
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
    controller, scraper, cache, clock = make(controller_type=HookedController)
    assert isinstance(controller, HookedController)
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


# --- warm-up ---------------------------------------------------------------------------------


def test_unreachable_from_start_warms_up_only_until_stale_after():
    controller, scraper, cache, clock = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.1.1:80": 0.0}  # 10.0.0.2 never answers
    asyncio.run(controller.tick())
    warming = controller.weights["p"].endpoints["10.0.0.2:80"]
    assert (warming.weight, warming.health, warming.saturated) == (10, "WARMING", False)
    assert warming.reason.startswith("warming up: no telemetry yet (connect: refused)")
    clock[0] += 3  # exactly stale_after_seconds since first seen: still warming
    asyncio.run(controller.tick())
    assert eds_weights(cache, "p")["10.0.0.2:80"] == 10
    clock[0] += 1
    asyncio.run(controller.tick())
    gone = controller.weights["p"].endpoints["10.0.0.2:80"]
    assert (gone.weight, gone.saturated, gone.stale) == (1, True, True)
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 90, "10.0.0.2:80": 1}
    scraper.pct["10.0.0.2:80"] = 60.0  # answers at last: weighted by the formula
    clock[0] += 1
    asyncio.run(controller.tick())
    assert eds_weights(cache, "p")["10.0.0.2:80"] == 70


def test_hold_staleness_does_not_hold_a_warm_up_weight():
    config = parse_config({
        "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
        "weights": {"policy": "composite", "composite": {"staleness": "hold"}},
        "pools": [{"name": "p", "model": "m", "endpoints": [{"address": "10.0.0.1:80"},
                                                             {"address": "10.0.0.2:80"}]}],
    })
    clock = [1000.0]
    controller = Controller(config, SnapshotCache(), scraper=FakeScraper(), clock=lambda: clock[0])
    good = ScrapeResult({"kv_usage": 0.2, "queue": 0.0}, None, 1000.0)
    controller.ingest({"10.0.0.1:80": good})
    assert controller.weights["p"].endpoints["10.0.0.2:80"].weight == 10
    clock[0] = 1004.0
    controller.ingest({"10.0.0.1:80": replace(good, collected_at=1004.0)})
    assert controller.weights["p"].endpoints["10.0.0.2:80"].weight == 1  # not 10, held forever


# --- rejected inputs -------------------------------------------------------------------------

COMPOSITE = parse_config({
    "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
    "weights": {"policy": "composite"},
    "pools": [{"name": "c", "model": "m", "endpoints": [
        {"address": "127.0.0.1:1", "metrics_url": "http://127.0.0.1:1/nan"},
        {"address": "127.0.0.1:2", "metrics_url": "http://127.0.0.1:1/ok"}]}],
})


def _vllm_page(kv: str, queue: int) -> str:
    rows = {"vllm:kv_cache_usage_perc": kv, "vllm:num_requests_waiting": queue,
            "vllm:num_requests_running": 1}
    return "".join(f'# TYPE {name} gauge\n{name}{{model_name="m"}} {value}\n'
                   for name, value in rows.items())




def _with_port(config, port: int):
    pool = config.pools[0]
    endpoints = [ep.model_copy(update={"metrics_url": ep.metrics_url.replace(":1/", f":{port}/")})
                 for ep in pool.endpoints]
    return config.model_copy(update={"pools": [pool.model_copy(update={"endpoints": endpoints})]})


def _errors(pool: str) -> float:
    return REGISTRY.get_sample_value("trimtab_telemetry_errors_total", {"pool": pool}) or 0.0


def test_nan_kv_usage_flags_the_endpoint_and_never_reaches_its_weight(caplog):
    async def scenario() -> Controller:
        runner, port = await serve_pages({"/nan": _vllm_page("NaN", 8), "/ok": _vllm_page("0.5", 8)})
        clock = [1000.0]
        controller = Controller(_with_port(COMPOSITE, port), SnapshotCache(),
                                clock=lambda: clock[0])
        try:
            for _ in range(2):
                await controller.tick()
                clock[0] += 1
        finally:
            await controller.close()
            await runner.cleanup()
        return controller

    before = _errors("c")
    with caplog.at_level(logging.WARNING, logger="trimtab.controller"):
        controller = asyncio.run(scenario())
    flagged = controller.weights["c"].endpoints["127.0.0.1:1"]
    assert flagged.problems and flagged.problems[0].startswith("kv_usage: ")
    assert "nan" in flagged.problems[0] and "input problems: kv_usage" in flagged.reason
    # never read valid: counted as saturated at once (not renormalised over the queue)
    assert flagged.signals["kv_usage"] == 1.0 and flagged.breakdown["input.kv_usage"] == 1.0
    assert flagged.problems[1] == "kv_usage: counted as saturated until it is valid again"
    assert flagged.health == "DEGRADED" and flagged.weight == 1
    assert controller.weights["c"].endpoints["127.0.0.1:2"].problems == ()
    assert _errors("c") - before == 2  # one flagged read per tick
    logged = [r for r in caplog.records if "input problems" in r.getMessage()]
    assert len(logged) == 1 and "c/127.0.0.1:1" in logged[0].getMessage()  # once per change


@pytest.mark.parametrize("bad", [math.nan, -1.0, 1.5, math.inf])
def test_out_of_range_signal_from_any_source_is_screened(bad: float):
    controller = Controller(COMPOSITE, SnapshotCache(), scraper=FakeScraper(),
                            clock=lambda: 1000.0)
    controller.ingest({"127.0.0.1:1": ScrapeResult({"kv_usage": bad, "queue": 8.0}, None, 1000.0),
                       "127.0.0.1:2": ScrapeResult({"kv_usage": 0.5, "queue": 8.0}, None, 1000.0)})
    flagged = controller.weights["c"].endpoints["127.0.0.1:1"]
    assert flagged.weight == 1 and flagged.health == "DEGRADED"  # saturated: no good value yet
    assert flagged.problems == (f"kv_usage: value {bad!r} rejected, outside [0, 1]",
                                "kv_usage: counted as saturated until it is valid again")
    assert controller.stats.problems == {"c/127.0.0.1:1": flagged.problems}
    controller.ingest({"127.0.0.1:1": ScrapeResult({"kv_usage": 0.5, "queue": 8.0}, None, 1000.0)})
    assert controller.weights["c"].endpoints["127.0.0.1:1"].problems == ()
    assert controller.stats.problems == {}


# --- telemetry work off the event loop (issue 13 §1) ------------------------------------------

def _on_worker() -> bool:
    return threading.current_thread().name.startswith("trimtab-telemetry")


def test_a_tick_weighs_and_builds_on_the_worker_and_applies_on_the_loop(monkeypatch):
    controller, scraper, cache, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    threads: dict[str, list[bool]] = {"weigh": [], "build": []}
    real_weigh, real_build = controller_module.cluster_weights, controller_module.build_snapshot

    def weigh(*args, **kwargs):
        threads["weigh"].append(_on_worker())
        return real_weigh(*args, **kwargs)

    def build(*args, **kwargs):
        threads["build"].append(_on_worker())
        return real_build(*args, **kwargs)

    monkeypatch.setattr(controller_module, "cluster_weights", weigh)
    monkeypatch.setattr(controller_module, "build_snapshot", build)
    asyncio.run(controller.tick())
    assert threads == {"weigh": [True, True], "build": [True]}  # pools p and q; one snapshot
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 90, "10.0.0.2:80": 60}
    assert controller.stats.stale == {"p/10.0.0.1:80": False, "p/10.0.0.2:80": False,
                                      "q/10.0.1.1:80": False}


OTHER = parse_config({
    "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
    "pools": [{"name": "r", "model": "m", "endpoints": [{"address": "10.0.2.1:80"}]}],
})


def _held_on_worker(monkeypatch, name: str) -> tuple[threading.Event, threading.Event]:
    """Make the worker's call of ``controller_module.<name>`` wait until released (the
    loop's own calls pass straight through); returns (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(controller_module, name)

    def held(*args, **kwargs):
        if _on_worker():
            entered.set()
            release.wait(10.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(controller_module, name, held)
    return entered, release


async def _tick_with_config_change(controller: Controller, entered: threading.Event,
                                   release: threading.Event) -> bool:
    """Tick; while the worker is held, the loop applies OTHER. True if the loop got to run
    while the worker held the tick."""
    tick = asyncio.create_task(controller.tick())
    await wait_until_async(entered.is_set, 10.0, "the worker to hold the tick", every=0.001)
    loop_ran_meanwhile = entered.is_set() and not tick.done()
    controller.apply_config(OTHER)
    release.set()
    await tick
    return loop_ran_meanwhile


def test_a_weighing_overtaken_by_a_new_config_is_dropped(monkeypatch):
    controller, scraper, cache, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    entered, release = _held_on_worker(monkeypatch, "cluster_weights")
    assert asyncio.run(_tick_with_config_change(controller, entered, release))
    assert set(controller.weights) <= {"r"}  # never the old config's pools
    assert set(cache.snapshot.of_type(T.ENDPOINT)) == {"r"}


def test_a_snapshot_built_from_inputs_that_changed_meanwhile_is_rebuilt(monkeypatch):
    controller, scraper, cache, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    entered, release = _held_on_worker(monkeypatch, "build_snapshot")
    assert asyncio.run(_tick_with_config_change(controller, entered, release))
    assert set(cache.snapshot.of_type(T.ENDPOINT)) == {"r"}
    assert set(cache.snapshot.of_type(T.CLUSTER)) == {"r"}


def test_a_page_over_max_series_per_page_is_refused_and_goes_stale():
    page = "# TYPE vllm:num_requests_waiting gauge\n" + "".join(
        f'vllm:num_requests_waiting{{model_name="m",i="{i}"}} 1\n' for i in range(51))
    config = parse_config({
        "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3, "max_series_per_page": 50},
        "weights": {"policy": "composite"},
        "pools": [{"name": "c", "model": "m", "endpoints": [
            {"address": "127.0.0.1:1", "metrics_url": "http://127.0.0.1:1/big"},
            {"address": "127.0.0.1:2", "metrics_url": "http://127.0.0.1:1/ok"}]}],
    })

    async def scenario() -> Controller:
        runner, port = await serve_pages({"/big": page, "/ok": _vllm_page("0.5", 8)})
        clock = [1000.0]
        controller = Controller(_with_port(config, port), SnapshotCache(), clock=lambda: clock[0])
        try:
            for _ in range(5):
                await controller.tick()
                clock[0] += 1
        finally:
            await controller.close()
            await runner.cleanup()
        return controller

    controller = asyncio.run(scenario())
    big = controller.store.observations(["127.0.0.1:1"])["127.0.0.1:1"]
    assert big.sample is None and big.error == too_many_series(50)
    assert controller.weights["c"].endpoints["127.0.0.1:1"].stale
    assert not controller.weights["c"].endpoints["127.0.0.1:2"].stale


def test_off_loop_tick_hooks_prepare_on_the_worker_and_apply_on_the_loop():
    controller, scraper, _, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}
    seen: dict[str, object] = {}

    def prepare():
        seen["prepared_on_worker"] = _on_worker()
        weights = dict(controller.weights)  # read-only work, off the loop
        return lambda: seen.update(applied_on=threading.current_thread(), weights=weights)

    controller.on_tick_off_loop.append(prepare)

    async def scenario() -> threading.Thread:
        await controller.tick()
        return threading.current_thread()

    loop_thread = asyncio.run(scenario())
    assert seen["prepared_on_worker"] is True and seen["applied_on"] is loop_thread
    assert set(seen["weights"]) == {"p", "q"}


def test_the_startup_heap_is_frozen_out_of_the_cyclic_gc_after_a_tick_until_close():
    import gc

    controller, scraper, _, _ = make()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0, "10.0.1.1:80": 0.0}

    async def scenario() -> tuple[int, int]:
        await controller.tick()
        frozen = gc.get_freeze_count()
        await controller.close()
        return frozen, gc.get_freeze_count()

    frozen, after_close = asyncio.run(scenario())
    assert frozen > 0 and after_close == 0  # closed: what it held can be collected again


@pytest.mark.parametrize("policy", ["queueing", "composite", "reference", "gpu_memory"])
def test_a_pool_never_read_since_start_warms_up_and_is_not_fail_static(policy):
    """Issue 25 item 3: a pool none of whose endpoints has been read since trimtab started
    lost nothing, so it is not fail-static at weight 1: its endpoints get warmup_weight and
    WARMING (docs/configuration.md, "Warm-up"), then go stale alone; a real loss still holds."""
    config = parse_config({
        "telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
        "weights": {"policy": policy},
        "pools": [{"name": "p", "model": "m", "endpoints": [{"address": "10.0.0.1:80"},
                                                           {"address": "10.0.0.2:80"}]}]})
    clock, scraper, cache = [1000.0], FakeScraper(), SnapshotCache()
    controller = Controller(config, cache, scraper=scraper, clock=lambda: clock[0])
    asyncio.run(controller.tick())
    pool = controller.weights["p"]
    assert not pool.fail_static
    assert {(ew.weight, ew.health) for ew in pool.endpoints.values()} == {(10, "WARMING")}
    assert eds_weights(cache, "p") == {"10.0.0.1:80": 10, "10.0.0.2:80": 10}
    clock[0] += 4  # past stale_after since first seen: stale, each on its own
    asyncio.run(controller.tick())
    pool = controller.weights["p"]
    assert not pool.fail_static
    assert {(ew.weight, ew.stale) for ew in pool.endpoints.values()} == {(1, True)}
    assert not any("fail-static" in ew.reason for ew in pool.endpoints.values())
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 20.0}
    for _ in range(3):
        clock[0] += 1
        asyncio.run(controller.tick())
    before = {a: ew.weight for a, ew in controller.weights["p"].endpoints.items()}
    scraper.pct = {}  # both lost at once after being read: a loss, held
    clock[0] += 1
    asyncio.run(controller.tick())
    pool = controller.weights["p"]
    assert pool.fail_static and {a: ew.weight for a, ew in pool.endpoints.items()} == before
