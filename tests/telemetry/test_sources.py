"""Telemetry sources over real HTTP: scrape (model page + node DCGM page), file, Prometheus."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.backends import BackendFleet, VllmPage, serve_pages, vllm_text
from xds_server.config.load import parse_config
from xds_server.config.pools import EndpointConfig
from xds_server.control.controller import Controller
from xds_server.telemetry.scrape import Scraper, ScrapeResult
from xds_server.telemetry.sources import FileSource, PrometheusSource, ScrapeSource
from xds_server.xds.cache import SnapshotCache

TIMEOUT = 0.5




# --- scrape: the node's DCGM page next to the model page -------------------------------------


def test_dcgm_failure_is_reported_and_the_last_gpu_memory_held_for_stale_after() -> None:
    held = ("dcgm: http: status 500 Internal Server Error; holding the last good "
            "gpu_mem_pct, gpu_util_pct (for at most 6s)")

    async def scenario(fleet: BackendFleet) -> list[ScrapeResult]:
        runner, port = await serve_pages({"/metrics": vllm_text(VllmPage(kv_usage=0.25, waiting=2))})
        endpoint = EndpointConfig(address=f"127.0.0.1:{port}", gpu="0",
                                  dcgm_url=f"http://{fleet.addresses[0]}/metrics")
        source = ScrapeSource(Scraper(TIMEOUT), with_slo=False, hold_seconds=6.0)
        clock, reads = [1000.0], []
        try:
            for step, mode in ((0, "ok"), (6, "error"), (1, "error"), (1, "ok")):
                fleet.set_metrics_mode(0, mode)  # type: ignore[arg-type]
                clock[0] += step
                reads.append((await source.collect([endpoint], lambda: clock[0]))[endpoint.address])
        finally:
            await source.close()
            await runner.cleanup()
        return reads

    with BackendFleet(count=1) as fleet:
        fleet.set_memory(0, used_mib=40000, total_mib=80000)
        ok, holding, dropped, again = asyncio.run(scenario(fleet))
    assert ok.signals is not None and ok.signals["gpu_mem_pct"] == 50.0 and ok.problems == ()
    assert holding.error is None and holding.signals is not None
    assert (holding.signals["gpu_mem_pct"], holding.signals["kv_usage"]) == (50.0, 0.25)
    assert holding.problems == (held,)
    assert dropped.error is None and dropped.signals is not None
    assert "gpu_mem_pct" not in dropped.signals and dropped.signals["queue"] == 2.0
    assert dropped.problems == ("dcgm: http: status 500 Internal Server Error; "
                                "no gpu_mem_pct or gpu_util_pct from it",)
    assert again.signals is not None and again.signals["gpu_mem_pct"] == 50.0
    assert again.problems == ()


def test_model_and_dcgm_pages_are_scraped_concurrently() -> None:
    """Every page of a tick is in flight at once: the model pages answer only after all
    three requests (both model pages and the node's DCGM page, which never answers) have
    arrived, so a scraper that fetched them one after another would see its first page
    refused (503) and report it. Proved by arrival, not by elapsed time."""
    timeout = 2.0
    page = vllm_text(VllmPage(kv_usage=0.5))
    expected = {"/a", "/b", "/dcgm"}

    async def scenario() -> tuple[dict[str, ScrapeResult], set[str]]:
        arrived: set[str] = set()
        everyone = asyncio.Event()

        async def handle(request: web.Request) -> web.Response:
            arrived.add(request.path)
            if arrived >= expected:
                everyone.set()
            if request.path == "/dcgm":
                await asyncio.sleep(10 * timeout)  # hangs: the DCGM scrape times out
            try:
                await asyncio.wait_for(everyone.wait(), 0.75 * timeout)
            except TimeoutError:
                return web.Response(status=503, text=f"only {sorted(arrived)} arrived")
            return web.Response(text=page)

        app = web.Application()
        for path in expected:
            app.router.add_get(path, handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        endpoints = [EndpointConfig(address=f"10.0.0.{i}:80", gpu=str(i), dcgm_url=f"{base}/dcgm",
                                    metrics_url=f"{base}/{name}")
                     for i, name in ((0, "a"), (1, "b"))]
        source = ScrapeSource(Scraper(timeout), with_slo=False, hold_seconds=6.0)
        try:
            results = await source.collect(endpoints, time.time)
        finally:
            await source.close()
            await runner.cleanup()
        return results, arrived

    results, arrived = asyncio.run(scenario())
    assert arrived == expected
    for result in results.values():
        assert result.error is None, result.error
        assert result.signals is not None and result.signals["kv_usage"] == 0.5
        assert len(result.problems) == 1 and result.problems[0].startswith("dcgm: timeout: ")


# --- file ------------------------------------------------------------------------------------


def _endpoints(*addresses: str, **extra: str) -> list[EndpointConfig]:
    return [EndpointConfig(address=a, **extra) for a in addresses]  # type: ignore[arg-type]


def test_file_source_maps_addresses_and_rereads_every_tick(tmp_path: Path) -> None:
    path = tmp_path / "signals.yaml"
    path.write_text(json.dumps({
        "10.0.0.1:80": {"kv_usage": 0.5, "queue": "3"},
        "10.0.0.2:80": {"kv_usage": 0.1, "queue": "many", "running": True},
        "10.0.0.4:80": "not a mapping",
    }))
    source = FileSource(str(path))
    endpoints = _endpoints("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80")
    first = asyncio.run(source.collect(endpoints, lambda: 1000.0))
    assert first["10.0.0.1:80"] == ScrapeResult({"kv_usage": 0.5, "queue": 3.0}, None, 1000.0)
    partial = first["10.0.0.2:80"]
    assert partial.signals == {"kv_usage": 0.1} and partial.error is None
    assert [p.split(":")[0] for p in partial.problems] == ["queue", "running"]
    assert first["10.0.0.3:80"].error == "file: no entry for 10.0.0.3:80"
    assert first["10.0.0.4:80"].error == "file: no entry for 10.0.0.4:80"
    path.write_text("10.0.0.3:80: {queue: 7}\n")
    second = asyncio.run(source.collect(endpoints, lambda: 1001.0))
    assert second["10.0.0.3:80"].signals == {"queue": 7.0}
    assert second["10.0.0.1:80"].error == "file: no entry for 10.0.0.1:80"


@pytest.mark.parametrize(("content", "message"), [
    ("- just\n- a list\n", "expected a mapping of address"),
    (None, "No such file"),
    ("{unclosed: [", "invalid YAML at line"),
    ("[" * 5000 + "]" * 5000, "nest"),  # yaml.safe_load: RecursionError, an uncaught crash
    ('a: &a ["x","x","x","x","x","x","x","x","x","x"]\n' + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 10)}]\n"
        for i in range(6)), "YAML nodes once aliases are expanded"),
    (b"caf\xe9: {queue: 1}\n", "not UTF-8 at offset 3"),
])
def test_unusable_file_fails_every_endpoint(tmp_path: Path, content: str | bytes | None,
                                            message: str) -> None:
    """A broken or hostile file (nesting, alias bomb, not UTF-8) fails the reads with the
    reason, within the config loader's bounds: never a crash of the tick."""
    path = tmp_path / "signals.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    results = asyncio.run(FileSource(str(path)).collect(_endpoints("a:1", "b:1"), lambda: 5.0))
    assert set(results) == {"a:1", "b:1"}
    for result in results.values():
        assert result.signals is None and str(result.error).startswith(f"file: {path}: ")
        assert message in str(result.error)


# --- prometheus: a label value per endpoint --------------------------------------------------


def _vector(*series: tuple[dict[str, str], str]) -> str:
    result = [{"metric": m, "value": [1796123661.3, v]} for m, v in series]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


ANSWERS = {
    "q_kv": (200, _vector(({"instance": "pod-a:9400"}, "0.5"),
                          ({"instance": "10.0.0.1:8000"}, "0.9"),  # ep 1 is named pod-a:9400
                          ({"instance": "10.0.0.2:8000"}, "NaN"),
                          ({"instance": "10.9.9.9:1"}, "0.3"))),
    "q_queue": (200, _vector(({"instance": "pod-a:9400"}, "3"),
                             ({"instance": "10.0.0.2:8000"}, "4"))),
    "q_pod_kv": (200, _vector(({"pod": "vllm-0"}, "0.25"), ({"instance": "vllm-1"}, "0.75"))),
    "q_bad": (400, json.dumps({"status": "error", "errorType": "bad_data",
                               "error": "parse error: unclosed left parenthesis"})),
}


async def _prometheus() -> tuple[web.AppRunner, str]:
    async def query(request: web.Request) -> web.Response:
        status, body = ANSWERS[request.query["query"]]
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _prom_config(url: str, label: str, queries: dict[str, str], endpoints: list[dict]):
    return parse_config({
        "telemetry": {"source": "prometheus",
                      "prometheus": {"url": url, "label": label, "queries": queries}},
        "weights": {"policy": "composite"},
        "pools": [{"name": "p", "model": "m", "endpoints": endpoints}],
    })


def _collect(label: str, queries: dict[str, str], endpoints: list[dict]
             ) -> tuple[dict[str, ScrapeResult], Controller]:
    async def scenario() -> tuple[dict[str, ScrapeResult], Controller]:
        runner, url = await _prometheus()
        config = _prom_config(url, label, queries, endpoints)
        source = PrometheusSource(config, timeout_seconds=2.0)
        controller = Controller(config, SnapshotCache(), clock=lambda: 1000.0)
        try:
            results = await source.collect(config.pools[0].endpoints, lambda: 1000.0)
            controller.ingest(results)
        finally:
            await source.close()
            await controller.close()
            await runner.cleanup()
        return results, controller

    return asyncio.run(scenario())


def test_prometheus_instance_label_maps_to_endpoints() -> None:
    results, controller = _collect("instance", {"kv_usage": "q_kv", "queue": "q_queue"}, [
        {"address": "10.0.0.1:8000", "instance": "pod-a:9400"},
        {"address": "10.0.0.2:8000"},
        {"address": "10.0.0.3:8000"},
    ])
    assert results["10.0.0.1:8000"] == ScrapeResult({"kv_usage": 0.5, "queue": 3.0}, None, 1000.0)
    nan = results["10.0.0.2:8000"]
    assert nan.signals == {"queue": 4.0}
    assert nan.problems == ("kv_usage: instance='10.0.0.2:8000' is nan",)
    assert results["10.0.0.3:8000"].signals is None
    assert results["10.0.0.3:8000"].error == "prometheus: no series with instance='10.0.0.3:8000'"
    flagged = controller.weights["p"].endpoints["10.0.0.2:8000"]
    # reported but garbled, never valid before: counted as saturated, not renormalised away
    assert flagged.problems == (*nan.problems,
                                "kv_usage: counted as saturated until it is valid again")
    assert flagged.weight == 1 and flagged.health == "DEGRADED"


def test_prometheus_other_label_and_a_failed_query_flag_each_endpoint() -> None:
    results, _ = _collect("pod", {"kv_usage": "q_pod_kv", "queue": "q_bad"}, [
        {"address": "10.0.0.1:8000", "instance": "vllm-0"},
        {"address": "10.0.0.2:8000", "instance": "vllm-1"},  # its series has no `pod` label
    ])
    good, missing = results["10.0.0.1:8000"], results["10.0.0.2:8000"]
    assert good.signals == {"kv_usage": 0.25} and good.error is None
    assert len(good.problems) == 1
    assert good.problems[0].startswith("queue: http: status 400 Bad Request; prometheus: bad_data")
    assert missing.signals is None and missing.error == f"prometheus: {good.problems[0]}"
