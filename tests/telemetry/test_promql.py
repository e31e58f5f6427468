"""Tests for the Prometheus (PromQL) signal source."""

from __future__ import annotations

import asyncio
import functools
import gc
import gzip
import json
import os
import shutil
import socket
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.wait import wait_until_async
from xds_server.telemetry.promql import (
    Answer,
    PromQLError,
    PromQLResult,
    PromQLSource,
    Vector,
    default_queries,
    merge_answers,
    parse_vector,
)

# Answers recorded from Prometheus 2.42 scraping a vLLM-format backend.
RECORDED_KV = (
    '{"status":"success","data":{"resultType":"vector","result":[{"metric":'
    '{"instance":"127.0.0.1:18301"},"value":[1796123661.260,"0.25"]}]}}'
)
RECORDED_RAW = (
    '{"status":"success","data":{"resultType":"vector","result":[{"metric":'
    '{"__name__":"vllm:kv_cache_usage_perc","engine":"0","instance":"127.0.0.1:18301",'
    '"job":"vllm","model_name":"m"},"value":[1796123661.277,"0.25"]}]}}'
)
RECORDED_NAN = (
    '{"status":"success","data":{"resultType":"vector","result":[{"metric":'
    '{"engine":"0","instance":"127.0.0.1:18301","job":"vllm","model_name":"m"},'
    '"value":[1796123661.286,"NaN"]}]}}'
)
RECORDED_EMPTY = '{"status":"success","data":{"resultType":"vector","result":[]}}'
RECORDED_PARSE_ERROR = (
    '{"status":"error","errorType":"bad_data","error":"invalid parameter \\"query\\": '
    '1:44: parse error: unclosed left parenthesis"}'
)


def vector(*series: tuple[dict[str, str], str]) -> str:
    result = [{"metric": m, "value": [1796123661.3, v]} for m, v in series]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


# --- parse_vector (pure) --------------------------------------------------------------------


def test_parse_recorded_answers() -> None:
    assert parse_vector(RECORDED_KV, "instance") == Vector({"127.0.0.1:18301": 0.25}, [], {})
    raw = parse_vector(RECORDED_RAW.encode(), "instance")
    assert raw == Vector({"127.0.0.1:18301": 0.25}, [], {})
    assert parse_vector(RECORDED_EMPTY, "instance") == Vector({}, [], {})
    values, problems, by_key = parse_vector(RECORDED_NAN, "instance")
    assert values == {} and problems == ["instance='127.0.0.1:18301' is nan"]
    assert by_key == {"127.0.0.1:18301": ["instance='127.0.0.1:18301' is nan"]}


def test_parse_other_label_missing_label_and_duplicates() -> None:
    body = vector(
        ({"pod": "vllm-0"}, "3"),
        ({"pod": "vllm-1"}, "+Inf"),
        ({"instance": "x"}, "1"),
        ({"pod": "vllm-0"}, "5"),
    )
    values, problems, by_key = parse_vector(body, "pod")
    assert values == {"vllm-0": 5.0}
    assert len(problems) == 3
    assert any("has no 'pod' label" in p for p in problems)
    assert any("appears twice" in p for p in problems)
    assert sorted(by_key) == ["vllm-0", "vllm-1"]  # the unlabelled series names no endpoint


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (RECORDED_PARSE_ERROR, "prometheus: bad_data: .*unclosed left parenthesis"),
        ("<html>502</html>", "format: answer is not JSON"),
        ("[1, 2]", "format: answer is not a JSON object"),
        (
            '{"status":"success","data":{"resultType":"scalar","result":[1,"1"]}}',
            "resultType='scalar'",
        ),
        ('{"status":"success","data":{"resultType":"vector","result":{}}}', "not a list"),
        (
            '{"status":"success","data":{"resultType":"vector","result":[{"metric":{}}]}}',
            "bad sample",
        ),
    ],
)
def test_parse_rejects_unusable_answers(body: str, message: str) -> None:
    with pytest.raises(PromQLError, match=message):
        parse_vector(body, "instance")


def test_parse_mixes_plain_and_irregular_series() -> None:
    series = [
        {"metric": {"instance": "a:1"}, "value": [1796123661.3, "0.5"]},
        {"metric": {"job": "x"}, "value": [1796123661.3, "1"]},  # no label
        {"value": [1796123661.3, "1"]},  # no metric at all
        {"metric": {"instance": None}, "value": [1796123661.3, "1"]},  # null label
        {"metric": {"instance": "b:1"}, "value": [1796123661.3, "NaN"]},
        {"metric": {"instance": "a:1"}, "value": [1796123661.3, "0.25"]},  # duplicate
        {"metric": {"instance": "c:1"}, "value": [1796123661.3, 2]},  # a number, not a string
    ]
    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": series}})
    values, problems, _ = parse_vector(body, "instance")
    assert values == {"a:1": 0.5, "c:1": 2.0}
    assert problems == [
        "series {'job': 'x'} has no 'instance' label",
        "series {} has no 'instance' label",
        "series {'instance': None} has no 'instance' label",
        "instance='b:1' is nan",
        "instance='a:1' appears twice; kept the larger value",
    ]


@pytest.mark.parametrize("bad", [[1, "2"], {"metric": {"instance": "a:1"}, "value": "x"}])
def test_parse_rejects_a_malformed_series_among_good_ones(bad: object) -> None:
    good = {"metric": {"instance": "a:1"}, "value": [1796123661.3, "0.5"]}
    result = [good, bad]
    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
    with pytest.raises(PromQLError, match="bad sample"):
        parse_vector(body, "instance")


@pytest.mark.parametrize("enabled", [True, False])
def test_parse_leaves_the_garbage_collector_as_it_was(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        parse_vector(RECORDED_KV, "instance")
        assert gc.isenabled() is enabled
        with pytest.raises(PromQLError):
            parse_vector("<html>502</html>", "instance")
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_merge_answers_maps_and_keeps_order() -> None:
    answers: dict[str, Answer] = {
        "kv_usage": Vector({"x": 0.5, "y": 0.1, "z": 0.9}, ["dup", "x nan"], {"x": ["x nan"]}),
        "queue": "timeout: no answer within 2s",
        "itl_ms": Vector({"y": 30.0, "x": 20.0, "w": 1.0}, [], {}),
    }
    plain = merge_answers(answers)
    assert list(plain.values) == ["x", "y", "z", "w"]
    assert plain.values["x"] == {"kv_usage": 0.5, "itl_ms": 20.0}
    assert plain.errors == {"queue": "timeout: no answer within 2s"}
    assert plain.problems == ("kv_usage: dup", "kv_usage: x nan")
    assert plain.endpoint_problems == {"x": ["kv_usage: x nan"]}
    mapped = merge_answers(answers, {"x": "pod-a:1", "y": "pod-b:1", "w": "pod-b:1"})
    assert mapped.values == {
        "pod-a:1": {"kv_usage": 0.5, "itl_ms": 20.0},
        "pod-b:1": {"kv_usage": 0.1, "itl_ms": 1.0},  # two labels, one address: the last wins
    }
    assert mapped.endpoint_problems == {"pod-a:1": ["kv_usage: x nan"]}
    unknown = merge_answers(answers, {"y": "pod-b:1"})
    assert unknown.endpoint_problems == {}  # a label value naming no endpoint


def test_default_queries_follow_the_label() -> None:
    queries = default_queries("pod", rate_window="30s")
    assert set(queries) == {"kv_usage", "queue", "running", "itl_ms", "gpu_mem_pct"}
    assert all("by (pod)" in q for q in queries.values())
    assert "[30s]" in queries["itl_ms"]
    assert queries["itl_ms"].endswith("[30s])) > 0)")  # idle: no series rather than NaN
    assert default_queries()["kv_usage"] == "max by (instance) (vllm:kv_cache_usage_perc)"


def test_source_validates_arguments() -> None:
    with pytest.raises(ValueError):
        PromQLSource("http://p:9090", timeout_seconds=0)
    with pytest.raises(ValueError):
        PromQLSource("http://p:9090", max_body_bytes=0)
    with pytest.raises(ValueError):
        PromQLSource("http://p:9090", queries={})


# --- PromQLSource against a fake Prometheus API ---------------------------------------------

FAKE_ANSWERS: dict[str, tuple[int, str]] = {
    "q_kv": (
        200,
        vector(({"instance": "10.0.0.1:8000"}, "0.5"), ({"instance": "10.0.0.2:8000"}, "0.1")),
    ),
    "q_queue": (
        200,
        vector(({"instance": "10.0.0.1:8000"}, "4"), ({"instance": "10.9.9.9:1"}, "7")),
    ),
    "q_bad": (400, RECORDED_PARSE_ERROR),
    "q_500": (503, "Service Unavailable"),
    "q_scalar": (200, '{"status":"success","data":{"resultType":"scalar","result":[1,"1"]}}'),
}


async def _fake_prometheus() -> tuple[web.AppRunner, str, list[str]]:
    seen: list[str] = []

    async def query(request: web.Request) -> web.Response:
        q = request.query["query"]
        seen.append(q)
        status, body = FAKE_ANSWERS[q]
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/", seen


def test_each_signal_fails_alone() -> None:
    async def scenario() -> tuple[PromQLResult, list[str]]:
        runner, url, seen = await _fake_prometheus()
        queries = {s: f"q_{s}" for s in ("kv", "queue", "bad", "500", "scalar")}
        source = PromQLSource(url, queries=queries)
        try:
            return await source.fetch(), seen
        finally:
            await source.close()
            await runner.cleanup()

    result, seen = asyncio.run(scenario())
    assert sorted(seen) == sorted(f"q_{s}" for s in ("kv", "queue", "bad", "500", "scalar"))
    assert result.values == {
        "10.0.0.1:8000": {"kv": 0.5, "queue": 4.0},
        "10.0.0.2:8000": {"kv": 0.1},
        "10.9.9.9:1": {"queue": 7.0},
    }
    assert set(result.errors) == {"bad", "500", "scalar"}
    assert result.errors["bad"].startswith("http: status 400 Bad Request; prometheus: bad_data")
    assert result.errors["500"].startswith("http: status 503")
    assert "resultType='scalar'" in result.errors["scalar"]


def test_address_mapping_keeps_only_known_endpoints() -> None:
    async def scenario() -> PromQLResult:
        runner, url, _ = await _fake_prometheus()
        source = PromQLSource(
            url,
            queries={"kv_usage": "q_kv", "queue": "q_queue"},
            address_of={"10.0.0.1:8000": "pod-a:8000"},
        )
        try:
            return await source.fetch()
        finally:
            await source.close()
            await runner.cleanup()

    result = asyncio.run(scenario())
    assert result == PromQLResult(values={"pod-a:8000": {"kv_usage": 0.5, "queue": 4.0}})


def test_prometheus_down_is_an_error_per_signal() -> None:
    async def scenario(port: int) -> PromQLResult:
        source = PromQLSource(f"http://127.0.0.1:{port}", timeout_seconds=2.0)
        try:
            return await source.fetch()
        finally:
            await source.close()

    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as refused:
        refused.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        result = asyncio.run(scenario(refused.getsockname()[1]))
    assert result.values == {}
    assert set(result.errors) == set(default_queries())
    assert all(e.startswith("connect: ") for e in result.errors.values())


# --- answers over the size limit -----------------------------------------------------------

LIMIT = 1024 * 1024  # bytes of decompressed answer the tests allow


def _padded_answer(padding: int) -> bytes:
    """A valid answer (JSON allows the whitespace) of ``padding`` bytes and more."""
    return vector(({"instance": "10.0.0.1:8000"}, "0.5")).encode() + b" " * padding


@functools.cache
def _bomb() -> bytes:
    return gzip.compress(_padded_answer(64 * 1024 * 1024), compresslevel=6)


async def _oversized_prometheus() -> tuple[web.AppRunner, str, dict[str, int]]:
    """``q_bomb``: 64 MiB of answer, gzipped to ~64 KiB; ``q_endless``: a chunked body that
    never ends (its bytes sent are counted); ``q_kv``: a normal answer."""
    bomb = _bomb()
    sent = {"endless": 0}

    async def query(request: web.Request) -> web.StreamResponse:
        q = request.query["query"]
        if q == "q_bomb":
            return web.Response(body=bomb, headers={"Content-Encoding": "gzip",
                                                    "Content-Type": "application/json"})
        if q == "q_endless":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(_padded_answer(0))
            chunk = b" " * 65536
            while True:  # until the client goes away
                await resp.write(chunk)
                sent["endless"] += len(chunk)
        return web.Response(text=FAKE_ANSWERS[q][1], content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/", sent


def _fetch_traced(queries: dict[str, str]) -> tuple[PromQLResult, int, float, dict[str, int]]:
    """Fetch ``queries`` once; also the peak traced memory and the time it took."""
    async def scenario() -> tuple[PromQLResult, int, float, dict[str, int]]:
        runner, url, sent = await _oversized_prometheus()
        source = PromQLSource(url, queries=queries, timeout_seconds=20.0, max_body_bytes=LIMIT)
        tracemalloc.start()
        try:
            started = time.monotonic()
            result = await source.fetch()
            elapsed = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            await source.close()
            await runner.cleanup()
        return result, peak, elapsed, sent

    return asyncio.run(scenario())


def test_a_gzip_bomb_answer_fails_its_query_at_the_limit() -> None:
    result, peak, elapsed, _ = _fetch_traced({"kv": "q_kv", "bomb": "q_bomb"})
    assert result.errors == {"bomb": f"size: Prometheus answer larger than {LIMIT} bytes "
                                      f"(decompressed); stopped reading, query not used"}
    assert result.values == {"10.0.0.1:8000": {"kv": 0.5}, "10.0.0.2:8000": {"kv": 0.1}}
    assert peak < 8 * LIMIT, f"peak {peak} bytes: the 64 MiB answer was not cut at the limit"


def test_an_endless_answer_stops_at_the_limit_not_the_timeout() -> None:
    result, peak, elapsed, sent = _fetch_traced({"endless": "q_endless"})
    assert result.errors["endless"].startswith(f"size: Prometheus answer larger than {LIMIT}")
    assert result.values == {}
    assert elapsed < 10.0  # the 20 s timeout was not what stopped it
    assert peak < 8 * LIMIT, f"peak {peak} bytes: reading did not stop at the limit"
    assert sent["endless"] < 32 * LIMIT  # the server saw the client stop reading


def test_an_oversized_answer_leaves_its_endpoints_without_telemetry() -> None:
    """Through the source a pool uses: the only query fails, so every endpoint's read is an
    error (it goes stale), saying why."""
    from xds_server.config.load import parse_config
    from xds_server.telemetry.sources import PrometheusSource

    async def scenario() -> dict[str, object]:
        runner, url, _ = await _oversized_prometheus()
        config = parse_config({
            "telemetry": {"source": "prometheus",
                          "prometheus": {"url": url, "queries": {"kv_usage": "q_bomb"}}},
            "pools": [{"name": "p", "model": "m",
                       "endpoints": [{"address": "10.0.0.1:8000"}]}]})
        source = PrometheusSource(config, timeout_seconds=20.0)
        source.source = PromQLSource(url, queries={"kv_usage": "q_bomb"}, timeout_seconds=20.0,
                                     max_body_bytes=LIMIT)
        try:
            return await source.collect(config.pools[0].endpoints, lambda: 1000.0)
        finally:
            await source.close()
            await runner.cleanup()

    results = asyncio.run(scenario())
    read = results["10.0.0.1:8000"]
    assert read.signals is None
    assert read.error == (f"prometheus: kv_usage: size: Prometheus answer larger than {LIMIT} "
                          f"bytes (decompressed); stopped reading, query not used")


# --- against a real Prometheus server -------------------------------------------------------


def _prometheus_binary() -> str | None:
    found = shutil.which("prometheus")
    if found:
        return found
    return "/usr/bin/prometheus" if os.access("/usr/bin/prometheus", os.X_OK) else None


PROMETHEUS = _prometheus_binary()
ITL_SECONDS = {"a": 0.020, "b": 0.045}


class FakeVllm:
    """A vLLM + DCGM metrics page whose ITL histogram grows on every scrape."""

    def __init__(self, kv: float, queue: int, running: int, used_mib: int, itl_s: float):
        self.kv, self.queue, self.running, self.used_mib = kv, queue, running, used_mib
        self.itl_s, self.scrapes = itl_s, 0

    def page(self) -> str:
        self.scrapes += 1
        n, m = self.scrapes * 10, 'engine="0",model_name="m"'
        gpu = 'gpu="0",UUID="GPU-1",modelName="NVIDIA H100 80GB HBM3"'
        return (
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{m}}} {self.kv}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{m}}} {self.queue}\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{m}}} {self.running}\n"
            "# TYPE vllm:inter_token_latency_seconds histogram\n"
            f'vllm:inter_token_latency_seconds_bucket{{{m},le="+Inf"}} {n}\n'
            f"vllm:inter_token_latency_seconds_count{{{m}}} {n}\n"
            f"vllm:inter_token_latency_seconds_sum{{{m}}} {n * self.itl_s}\n"
            f"# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{{{gpu}}} {self.used_mib}\n"
            f"# TYPE DCGM_FI_DEV_FB_FREE gauge\nDCGM_FI_DEV_FB_FREE{{{gpu}}} {80000 - self.used_mib}\n"
        )


async def _serve(backend: FakeVllm) -> tuple[web.AppRunner, int]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=backend.page())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


def _free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_prometheus(tmp: Path, targets: list[str], port: int) -> subprocess.Popen[bytes]:
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    log = (tmp / "prometheus.log").open("wb")
    return subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


async def _until(
    source: PromQLSource,
    done: Callable[[PromQLResult], bool],
    proc: subprocess.Popen[bytes],
    deadline_s: float = 60.0,
) -> PromQLResult:
    """Poll until ``done(result)``; fail (not hang) if Prometheus dies or never gets there."""

    async def fetch() -> PromQLResult:
        result = await source.fetch()
        assert proc.poll() is None, f"prometheus exited with {proc.returncode}"
        return result

    return await wait_until_async(fetch, deadline_s, "the PromQL result", check=done, every=0.5)


def _complete(addresses: list[str], signals: set[str]) -> Callable[[PromQLResult], bool]:
    return lambda r: all(signals <= set(r.values.get(a, {})) for a in addresses)


@pytest.mark.slow
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed")
def test_real_prometheus_scraping_vllm_backends(tmp_path: Path) -> None:
    backends = {
        "a": FakeVllm(kv=0.25, queue=3, running=9, used_mib=20000, itl_s=ITL_SECONDS["a"]),
        "b": FakeVllm(kv=0.75, queue=0, running=2, used_mib=60000, itl_s=ITL_SECONDS["b"]),
    }

    async def scenario() -> None:
        runners, ports = {}, {}
        for name, backend in backends.items():
            runners[name], ports[name] = await _serve(backend)
        addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        prom_port = _free_port()
        proc = _start_prometheus(tmp_path, sorted(addr.values()), prom_port)
        queries = default_queries() | {"broken": "max by (instance) (vllm:kv_cache_usage_perc"}
        source = PromQLSource(f"http://127.0.0.1:{prom_port}", queries=queries)
        try:
            await _check_real(source, proc, addr, backends)
        finally:
            await source.close()
            _stop(proc)
            for runner in runners.values():
                await runner.cleanup()

    asyncio.run(scenario())


async def _check_real(
    source: PromQLSource,
    proc: subprocess.Popen[bytes],
    addr: dict[str, str],
    backends: dict[str, FakeVllm],
) -> None:
    every = set(default_queries())
    result = await _until(source, _complete(list(addr.values()), every), proc)
    a, b = result.values[addr["a"]], result.values[addr["b"]]
    assert (a["kv_usage"], a["queue"], a["running"]) == (0.25, 3.0, 9.0)
    assert (b["kv_usage"], b["queue"], b["running"]) == (0.75, 0.0, 2.0)
    assert (a["gpu_mem_pct"], b["gpu_mem_pct"]) == (25.0, 75.0)
    assert a["itl_ms"] == pytest.approx(1000 * ITL_SECONDS["a"], rel=1e-6)
    assert b["itl_ms"] == pytest.approx(1000 * ITL_SECONDS["b"], rel=1e-6)
    assert set(result.errors) == {"broken"}
    assert "bad_data" in result.errors["broken"]
    assert "broken" not in a

    # A value changed on a backend shows up through Prometheus.
    backends["b"].kv = 0.125
    await _until(source, lambda r: r.values.get(addr["b"], {}).get("kv_usage") == 0.125, proc)
