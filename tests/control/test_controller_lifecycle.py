"""What a long run does to the controller: discovery churn (sources kept, nothing left behind
in memory or /metrics), reloads (every key applied, the tick interval at once; restart-only
keys refused) and rollout commands whose state file cannot be written (nothing changed)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from pathlib import Path

import yaml
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.support.wait import wait_until_async
from xds_server.admin import metrics
from xds_server.admin.api import AdminApi
from xds_server.app import Trimtab, restart_only_changes
from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.control.discovery.kubernetes import DiscoveredEndpoint
from xds_server.control.discovery.merge import Discovery
from xds_server.control.rollouts.machine import load_state
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache


class AnyFleet:
    """Every endpoint answers with two signals (so each has weight, stale and signal series)."""

    async def scrape(self, targets, now, parse=None):
        return {a: ScrapeResult({"gpu_mem_pct": 30.0, "kv_usage": 0.3}, None, now())
                for a in targets}

    async def close(self) -> None:
        pass


CHURN = {
    "pools": [{"name": "churn", "model": "m",
               "discovery": {"kubernetes": {"namespace": "ns", "service": "svc"}}},
              {"name": "fixed", "model": "f", "endpoints": [{"address": "10.9.0.1:80"}]}],
}


def _found(first: int, count: int = 8) -> tuple[DiscoveredEndpoint, ...]:
    return tuple(DiscoveredEndpoint(f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}:8000",
                                    True, True, False) for i in range(first, first + count))


def _series(pools: set[str], controller: Controller) -> int:
    """The /metrics series labelled with these pools: the global registry's and the fleet's."""
    text = metrics.exposition(metrics.FleetCollector(lambda: controller.weights)).decode()
    return sum(1 for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.labels.get("pool") in pools)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_thousand_discovery_changes_leave_no_series_sources_or_memory_behind() -> None:
    base = parse_config(CHURN)
    cache = SnapshotCache()
    controller = Controller(base, cache, scraper=AnyFleet(), clock=lambda: 1000.0)

    discovery = Discovery(controller.reconcile)  # what Trimtab wires discovery to
    discovery.base = base
    sources = dict(controller.sources)

    async def churn(changes: int, start: int) -> None:
        for change in range(start, start + changes):
            discovery._update("churn", _found(3 * change))  # 3 of 8 endpoints replaced
            await controller.tick()

    asyncio.run(churn(20, 0))
    baseline = _series({"churn", "fixed"}, controller)
    assert baseline >= 8 * 4  # weight, stale and two signals per endpoint, and pool gauges
    gc.collect()
    rss = _rss_bytes()
    asyncio.run(churn(1000, 20))
    gc.collect()
    grown = _rss_bytes() - rss
    assert _series({"churn", "fixed"}, controller) == baseline
    assert grown < 20 * 1024 * 1024, f"RSS grew {grown / 2**20:.1f} MiB"
    assert controller.sources == sources  # the same objects: sessions and held reads kept
    assert len(controller.weights["churn"].endpoints) == 8
    assert len(controller.stats.stale) == 9
    assert len(controller.store.observations(
        [a for a in controller.store._first_seen])) == 9  # noqa: SLF001
    text = metrics.exposition(metrics.FleetCollector(lambda: controller.weights)).decode()
    assert '10.0.0.0:8000' not in text  # the first endpoints are long gone
    assert 'trimtab_endpoint_weight{endpoint="' in text  # while the current ones are there


PROMETHEUS = {
    "telemetry": {"source": "prometheus", "prometheus": {"url": "http://127.0.0.1:1"}},
    "pools": [{"name": "prom", "model": "m", "endpoints": [{"address": "10.8.0.1:80"}]}],
}


def test_a_replaced_source_is_closed_and_an_unchanged_one_kept() -> None:
    async def scenario() -> None:
        config = parse_config(PROMETHEUS)
        controller = Controller(config, SnapshotCache(), scraper=AnyFleet(), clock=lambda: 1000.0)
        await controller.tick()  # opens the PromQL session (the query fails: nothing listens)
        source = controller.sources["prometheus"]
        assert source.source._session is not None  # type: ignore[attr-defined]
        pool = config.pools[0].model_copy(update={"endpoints": [
            *config.pools[0].endpoints, config.pools[0].endpoints[0].model_copy(
                update={"address": "10.8.0.2:80"})]})
        controller.apply_config(config.model_copy(update={"pools": [pool]}))  # discovery
        assert controller.sources["prometheus"] is source
        moved = parse_config({**PROMETHEUS, "telemetry": {
            "source": "prometheus", "prometheus": {"url": "http://127.0.0.1:2"}}})
        controller.apply_config(moved)
        assert controller.sources["prometheus"] is not source
        await asyncio.sleep(0.05)  # closed in the background
        assert source.source._session is None  # type: ignore[attr-defined]
        await controller.close()

    asyncio.run(scenario())


def test_gone_pools_leave_no_pool_or_rollout_series() -> None:
    versions = {"name": "gone", "model": "g", "versions": {
        "stable": {"endpoints": [{"address": "10.7.0.1:80"}]},
        "canary": {"endpoints": [{"address": "10.7.0.2:80"}]}}}
    with_pool = parse_config({"rollouts": {"state_file": ""}, "pools": [
        versions, {"name": "stays", "model": "s", "endpoints": [{"address": "10.7.1.1:80"}]}]})
    controller = Controller(with_pool, SnapshotCache(), scraper=AnyFleet(), clock=lambda: 1000.0)
    asyncio.run(controller.tick())
    names = {"gone", "gone-stable", "gone-canary"}
    assert _series(names, controller) > 0
    controller.apply_config(parse_config({"pools": [
        {"name": "stays", "model": "s", "endpoints": [{"address": "10.7.1.1:80"}]}]}))
    asyncio.run(controller.tick())
    assert _series(names, controller) == 0
    assert all(not key.startswith("gone") for key in controller.stats.stale)


# --- reload ----------------------------------------------------------------------------------


def _static(interval: float) -> dict:
    return {"telemetry": {"interval_seconds": interval, "source": "static"},
            "pools": [{"name": "s", "model": "m", "endpoints": [
                {"address": "10.6.0.1:80", "signals": {"gpu_mem_pct": 10.0}}]}]}


def test_reload_takes_a_new_tick_interval_at_once() -> None:
    async def scenario() -> int:
        controller = Controller(parse_config(_static(30.0)), SnapshotCache())
        stop = asyncio.Event()
        runner = asyncio.create_task(controller.run(stop))
        await wait_until_async(lambda: controller.stats.ticks, 10.0, "the first tick")
        await controller.reload(parse_config(_static(0.05)))
        await asyncio.sleep(0.6)
        stop.set()
        await runner
        await controller.close()
        return controller.stats.ticks

    assert asyncio.run(scenario()) >= 5  # not 1: the 30 s wait is re-planned


def _write(path: Path, doc: dict) -> None:
    path.write_text(yaml.safe_dump(doc))


def test_trimtab_reload_refuses_a_restart_only_key_and_keeps_the_old_config(tmp_path, caplog):
    path = tmp_path / "trimtab.yaml"
    _write(path, _static(2.0))
    trimtab = Trimtab(parse_config(_static(2.0)), path)
    changed = _static(1.0)
    changed["xds"] = {"address": "127.0.0.1:18555"}
    changed["admin"] = {"auth": {"token_env": "SOME_TOKEN"}}
    _write(path, changed)
    with caplog.at_level(logging.ERROR, logger="trimtab"):
        assert asyncio.run(trimtab.reload()) is False
    refused = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
    assert any(m.startswith("reload refused: xds.address: cannot change while running")
               for m in refused), refused
    assert any("admin.auth.token_env" in m for m in refused), refused
    assert trimtab.config.telemetry.interval_seconds == 2.0  # nothing applied
    assert trimtab.controller.config.telemetry.interval_seconds == 2.0
    del changed["xds"], changed["admin"]
    _write(path, changed)
    assert asyncio.run(trimtab.reload()) is True
    assert trimtab.controller.config.telemetry.interval_seconds == 1.0
    assert trimtab.history.max_points == 600  # 10 minutes at the new 1 s tick


def test_restart_only_changes_name_the_leaf_keys() -> None:
    old = parse_config(_static(2.0))
    new = parse_config({**_static(2.0), "keda": {"address": "127.0.0.1:9000"},
                        "rollouts": {"state_file": "elsewhere.json"},
                        "xds": {"limits": {"max_streams": 5}}})
    assert restart_only_changes(old, new) == ["xds.limits.max_streams", "keda.address",
                                              "rollouts.state_file"]
    assert restart_only_changes(old, parse_config(_static(1.0))) == []


def test_reload_of_an_unreadable_file_is_refused_with_one_line(tmp_path, caplog):
    path = tmp_path / "trimtab.yaml"
    _write(path, _static(2.0))
    trimtab = Trimtab(parse_config(_static(2.0)), path)
    path.write_bytes(b"pools:\n- name: \xff\xfe\n")
    with caplog.at_level(logging.ERROR, logger="trimtab"):
        assert asyncio.run(trimtab.reload()) is False
    refused = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
    assert len(refused) == 1 and "not UTF-8" in refused[0], refused
    path.write_text("a: &a [*a]\n")
    assert asyncio.run(trimtab.reload()) is False  # recursive alias: refused, not a crash


# --- rollout commands that cannot be saved ---------------------------------------------------


def _rollout_config(state_file: Path):
    return parse_config({
        "rollouts": {"state_file": str(state_file)},
        "pools": [{"name": "p", "model": "m",
                   "versions": {"stable": {"endpoints": [{"address": "10.5.0.1:80"}]},
                                "canary": {"endpoints": [{"address": "10.5.0.2:80"}]}}}]})


def test_a_rollout_command_that_cannot_be_saved_changes_nothing(tmp_path) -> None:
    state_dir = tmp_path / "state"
    state_file = state_dir / "rollouts.json"
    controller = Controller(_rollout_config(state_file), SnapshotCache(), scraper=AnyFleet(),
                            clock=lambda: 1000.0, state_file=state_file)
    asyncio.run(controller.tick())  # starts the rollout (10 %) and writes the file
    saved = state_file.read_text()
    routes = controller.cache.snapshot.of_type(T.ROUTE)["trimtab-routes"].version
    before = controller.rollouts.document()
    state_file.unlink()
    state_dir.rmdir()
    state_dir.write_text("not a directory")  # the state file cannot be written now (even as root)

    async def command() -> tuple[int, dict]:
        api = AdminApi(controller, lambda: True)
        async with TestClient(TestServer(api.app())) as client:
            resp = await client.post("/v1/rollouts/p/promote", json={})
            return resp.status, await resp.json()

    status, body = asyncio.run(command())
    assert status == 500, body
    message = body["error"]["message"]
    assert "cannot write the rollout state file" in message and str(state_file) in message
    assert "not applied" in message
    assert controller.rollouts.document() == before  # in memory: unchanged
    assert controller.canary_percent == {"p": 10.0}
    assert controller.cache.snapshot.of_type(T.ROUTE)["trimtab-routes"].version == routes
    state_dir.unlink()
    state_dir.mkdir()
    state_file.write_text(saved)
    assert load_state(state_file)["p"].phase == "progressing"
    status, body = asyncio.run(command())  # writable again: applied and saved
    assert status == 200 and body["phase"] == "promoted"
    assert json.loads(state_file.read_text())["rollouts"]["p"]["phase"] == "promoted"
