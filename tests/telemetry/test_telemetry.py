"""Tests for DCGM pages, the page bounds, the async scraper and the telemetry store."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import closing

import pytest
from aiohttp import web

from tests.support.paths import METRICS_FIXTURES
from weight_calculator.types import Observation, Sample
from xds_server.telemetry import bounds, worker
from xds_server.telemetry.bounds import refuse_unparsed, series_over, too_many_series
from xds_server.telemetry.parsers import page_signals, parse_page
from xds_server.telemetry.parsers.reader import MetricsFormatError
from xds_server.telemetry.scrape import Scraper, ScrapeResult
from xds_server.telemetry.store import TelemetryStore

FIXTURES = METRICS_FIXTURES
TIMEOUT = 0.5
NOW = 1_700_000_000.0


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def dcgm_line(metric: str, gpu: str, value: str, uuid: str = "GPU-x") -> str:
    return f'{metric}{{gpu="{gpu}",UUID="{uuid}",device="nvidia{gpu}"}} {value}\n'


# --- DCGM pages through the one page parser ------------------------------------------------


def test_parse_single_gpu_page() -> None:
    reading = parse_page(page("dcgm_single_gpu.txt"))
    assert (reading.server, reading.gpu_mem_pct, reading.problems) == ("dcgm", 25.0, ())


def test_parse_multi_gpu_takes_busiest() -> None:
    # FB_USED series are listed in a different GPU order than FB_FREE on purpose.
    assert parse_page(page("dcgm_multi_gpu.txt")).gpu_mem_pct == 75.0


def test_parse_vllm_page_reads_its_dcgm_series_too() -> None:
    reading = parse_page(page("vllm_with_dcgm.txt"))
    assert reading.server == "vllm" and reading.has_dcgm
    assert reading.gpu_mem_pct == pytest.approx(100.0 * 70000 / 81559)


def test_a_page_without_dcgm_series_has_no_gpu_memory_and_no_problem() -> None:
    vllm_only = "\n".join(
        line for line in page("vllm_with_dcgm.txt").splitlines() if "DCGM" not in line
    )
    reading = parse_page(vllm_only + "\n")
    assert reading.gpu_mem_pct is None and not reading.has_dcgm and reading.problems == ()


@pytest.mark.parametrize(
    ("fixture", "problem"),
    [
        ("dcgm_missing_fb_free.txt", "gpu_mem_pct: DCGM_FI_DEV_FB_USED/DCGM_FI_DEV_FB_FREE not paired"),
        ("dcgm_nan.txt", "gpu_mem_pct: DCGM_FI_DEV_FB_USED/DCGM_FI_DEV_FB_FREE are nan/60000.0"),
    ],
)
def test_a_garbled_memory_series_is_a_problem_not_a_value(fixture: str, problem: str) -> None:
    reading = parse_page(page(fixture))
    assert reading.gpu_mem_pct is None
    assert len(reading.problems) == 1 and reading.problems[0].startswith(problem)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (page("garbage.txt"), "not a Prometheus text page"),
        ("", "no recognised model-server or DCGM metrics"),
        (
            dcgm_line("DCGM_FI_DEV_FB_USED", "0", "-1")
            + dcgm_line("DCGM_FI_DEV_FB_FREE", "0", "5"),
            "are -1.0/5.0",
        ),
        (
            dcgm_line("DCGM_FI_DEV_FB_USED", "0", "+Inf")
            + dcgm_line("DCGM_FI_DEV_FB_FREE", "0", "5"),
            "are inf/5.0",
        ),
        (
            dcgm_line("DCGM_FI_DEV_FB_USED", "0", "0") + dcgm_line("DCGM_FI_DEV_FB_FREE", "0", "0"),
            "are 0.0/0.0",
        ),
        (
            dcgm_line("DCGM_FI_DEV_FB_USED", "0", "1")
            + dcgm_line("DCGM_FI_DEV_FB_FREE", "0", "1")
            + dcgm_line("DCGM_FI_DEV_FB_USED", "1", "1", uuid="GPU-y"),
            r"not paired for \[\('1', 'GPU-y'\)\]",
        ),
    ],
)
def test_a_page_with_no_usable_signal_is_refused(text: str, message: str) -> None:
    with pytest.raises(MetricsFormatError, match=message):
        parse_page(text)


def test_duplicate_memory_series_count_as_their_maximum() -> None:
    text = (dcgm_line("DCGM_FI_DEV_FB_USED", "0", "1") + dcgm_line("DCGM_FI_DEV_FB_USED", "0", "2")
            + dcgm_line("DCGM_FI_DEV_FB_FREE", "0", "1"))
    assert parse_page(text).gpu_mem_pct == pytest.approx(100 * 2 / 3)


def test_format_error_is_a_value_error() -> None:
    assert issubclass(MetricsFormatError, ValueError)


# --- Scraper against a real aiohttp server --------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _start(routes: dict[str, Handler]) -> tuple[web.AppRunner, int]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def _text(body: str, status: int = 200) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(text=body, status=status)

    return handler


def _stall_headers(release: asyncio.Event) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text=page("dcgm_single_gpu.txt"))

    return handler


def _stall_body(release: asyncio.Event) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(page("dcgm_single_gpu.txt")[:100].encode())
        await release.wait()
        return resp

    return handler


def _refusing_port() -> socket.socket:
    """A bound but non-listening socket: connecting to its port is refused, race-free."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_scrape_isolates_failures_and_is_bounded_by_timeout() -> None:
    async def scenario() -> tuple[dict[str, ScrapeResult], float]:
        release = asyncio.Event()
        routes: dict[str, Handler] = {
            "/good": _text(page("dcgm_single_gpu.txt")),
            "/vllm": _text(page("vllm_with_dcgm.txt")),
            "/garbage": _text(page("garbage.txt")),
            "/missing": _text("not here", status=404),
            "/stall-body": _stall_body(release),
            **{f"/slow{i}": _stall_headers(release) for i in range(3)},
        }
        runner, port = await _start(routes)
        scraper = Scraper(timeout_seconds=TIMEOUT)
        with closing(_refusing_port()) as refused:
            dead = refused.getsockname()[1]
            targets = {f"10.0.0.1:{p.strip('/')}": f"http://127.0.0.1:{port}{p}" for p in routes}
            targets["10.0.0.9:dead"] = f"http://127.0.0.1:{dead}/metrics"
            started = time.monotonic()
            try:
                results = await scraper.scrape(targets, now=lambda: NOW)
            finally:
                elapsed = time.monotonic() - started
                release.set()
                await scraper.close()
                await runner.cleanup()
        return results, elapsed

    results, elapsed = asyncio.run(scenario())
    errors = {a: r.error for a, r in results.items()}
    assert results["10.0.0.1:good"].signals == page_signals(page("dcgm_single_gpu.txt"))
    assert results["10.0.0.1:vllm"].signals is not None
    assert errors["10.0.0.1:good"] is None and errors["10.0.0.1:vllm"] is None
    assert str(errors["10.0.0.1:garbage"]).startswith("parse: MetricsFormatError")
    assert errors["10.0.0.1:missing"] == "http: status 404 Not Found"
    assert str(errors["10.0.0.9:dead"]).startswith("connect: ")
    for slow in ("stall-body", "slow0", "slow1", "slow2"):
        assert str(errors[f"10.0.0.1:{slow}"]).startswith("timeout: "), slow
        assert results[f"10.0.0.1:{slow}"].signals is None
    assert all(r.collected_at == NOW for r in results.values())
    assert list(results) == sorted(results)
    # Four slow endpoints would take 4 * TIMEOUT in sequence; concurrently ~1 * TIMEOUT.
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT * 3


def test_scrape_respects_max_concurrency_and_custom_parser() -> None:
    state = {"in_flight": 0, "peak": 0}

    async def counting(_: web.Request) -> web.StreamResponse:
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])
        await asyncio.sleep(0.05)  # hold the request open so overlaps would be visible
        state["in_flight"] -= 1
        return web.Response(text="load 7\n")

    async def scenario() -> dict[str, ScrapeResult]:
        runner, port = await _start({"/m": counting})
        scraper = Scraper(timeout_seconds=5.0, max_concurrency=2, parse=lambda t: {"n": len(t)})
        try:
            targets = {f"h{i}:1": f"http://127.0.0.1:{port}/m" for i in range(6)}
            first = await scraper.scrape(targets, now=lambda: NOW)
            await scraper.close()  # a later scrape reopens the session lazily
            second = await scraper.scrape({"h0:1": targets["h0:1"]}, now=lambda: NOW + 1)
        finally:
            await scraper.close()
            await runner.cleanup()
        return {**first, "again": second["h0:1"]}

    results = asyncio.run(scenario())
    assert state["peak"] <= 2
    assert all(r.signals == {"n": 7} and r.error is None for r in results.values())
    assert results["again"].collected_at == NOW + 1
    assert len(results) == 7


def test_scrape_nothing_returns_empty() -> None:
    async def scenario() -> dict[str, ScrapeResult]:
        scraper = Scraper(timeout_seconds=1.0)
        try:
            return await scraper.scrape({}, now=lambda: NOW)
        finally:
            await scraper.close()

    assert asyncio.run(scenario()) == {}


def _gauge_page(series: int, comments_per_series: int = 0) -> str:
    lines = ["# TYPE load gauge\n"]
    for i in range(series):
        lines += ["# a comment\n", "\n"] * comments_per_series
        lines.append(f'load{{i="{i}"}} 1\n')
    return "".join(lines)


def test_series_over_counts_samples_only() -> None:
    assert not series_over(_gauge_page(100, comments_per_series=3), 100)  # 701 lines, 100 series
    assert series_over(_gauge_page(101, comments_per_series=3), 100)
    assert series_over(_gauge_page(101), 100) and not series_over(_gauge_page(100), 100)
    assert not series_over("  \n\t# HELP x y\n  x 1  \n", 1)  # stripped as the parser does
    assert series_over("x 1\n  x 2", 1)  # the last line needs no newline


def test_series_over_stops_reading_at_the_first_series_past_the_limit(monkeypatch) -> None:
    read: list[str] = []

    class CountingStringIO(io.StringIO):
        def __next__(self) -> str:
            line = super().__next__()
            read.append(line)
            return line

    monkeypatch.setattr(bounds, "io", type("io", (), {"StringIO": CountingStringIO}))
    assert series_over(_gauge_page(100_000), 10)
    assert len(read) == 12  # the TYPE line and 11 samples, of 100,001 lines


def test_a_page_of_comments_or_blank_lines_is_bounded_too() -> None:
    """Parse time follows lines, not only samples: a page of 1 series and 16 MiB of blank
    lines or comments is refused unparsed as well."""
    assert refuse_unparsed(_gauge_page(100, comments_per_series=1), 100) is None  # 301 lines
    for filler in ("\n", "# c\n"):
        page = "x 1\n" + filler * 401
        assert not series_over(page, 100)
        assert refuse_unparsed(page, 100) == (
            "series: the endpoint's page has more than 400 lines "
            "(4 × telemetry.max_series_per_page); refused without parsing it")


def test_page_over_the_series_cap_is_refused_unparsed_and_flagged() -> None:
    parsed: list[int] = []

    def parse(text: str) -> dict[str, float]:
        parsed.append(len(text))
        return {"load": 1.0}

    async def scenario() -> dict[str, ScrapeResult]:
        runner, port = await _start({"/big": _text(_gauge_page(1_001)),
                                     "/ok": _text(_gauge_page(1_000, comments_per_series=1))})
        scraper = Scraper(timeout_seconds=5.0, parse=parse, max_series_per_page=1_000)
        try:
            return await scraper.scrape({"big:1": f"http://127.0.0.1:{port}/big",
                                         "ok:1": f"http://127.0.0.1:{port}/ok"}, now=lambda: NOW)
        finally:
            await scraper.close()
            await runner.cleanup()

    results = asyncio.run(scenario())
    assert results["big:1"] == ScrapeResult(None, too_many_series(1_000), NOW)
    assert results["big:1"].error.startswith(
        "series: the endpoint's page has more than 1000 series (telemetry.max_series_per_page)")
    assert results["ok:1"].signals == {"load": 1.0}
    assert parsed == [len(_gauge_page(1_000, comments_per_series=1))]  # the big page never


def test_scraper_parses_on_the_worker_thread_while_the_loop_serves() -> None:
    """The parse runs off the loop thread, and the loop runs other callbacks meanwhile: the
    parser waits until the loop has ticked 20 times, which it could not if it ran there."""
    loop_ticks = [0]
    seen: dict[str, object] = {}

    def parse(text: str) -> dict[str, float]:
        seen["thread"] = threading.current_thread()
        start = loop_ticks[0]
        deadline = time.monotonic() + 10.0
        while loop_ticks[0] < start + 20 and time.monotonic() < deadline:
            time.sleep(0.001)
        seen["loop_ticks_during_parse"] = loop_ticks[0] - start
        return {"load": 1.0}

    async def ticker() -> None:
        while True:
            loop_ticks[0] += 1
            await asyncio.sleep(0)

    async def scenario() -> tuple[dict[str, ScrapeResult], threading.Thread]:
        runner, port = await _start({"/m": _text("load 1\n")})
        scraper = Scraper(timeout_seconds=15.0, parse=parse)
        background = asyncio.create_task(ticker())
        try:
            return await scraper.scrape({"a:1": f"http://127.0.0.1:{port}/m"},
                                        now=lambda: NOW), threading.current_thread()
        finally:
            background.cancel()
            await scraper.close()
            await runner.cleanup()

    results, loop_thread = asyncio.run(scenario())
    assert results["a:1"].signals == {"load": 1.0}
    assert seen["thread"] is not loop_thread
    assert str(getattr(seen["thread"], "name", "")).startswith("trimtab-telemetry")
    assert seen["loop_ticks_during_parse"] >= 20


@pytest.mark.parametrize(
    "kwargs", [{"timeout_seconds": 0}, {"timeout_seconds": 1, "max_concurrency": 0},
               {"timeout_seconds": 1, "max_series_per_page": 0}]
)
def test_scraper_rejects_bad_settings(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Scraper(**kwargs)


# --- TelemetryStore --------------------------------------------------------------------------


def ok(pct: float, at: float) -> ScrapeResult:
    return ScrapeResult(signals={"gpu_mem_pct": pct}, error=None, collected_at=at)


def failed(at: float, error: str = "timeout: no complete answer within 1s") -> ScrapeResult:
    return ScrapeResult(signals=None, error=error, collected_at=at)


def test_store_keeps_last_good_sample_on_failure() -> None:
    store = TelemetryStore()
    store.record("a:1", ok(40.0, NOW))
    store.record("a:1", failed(NOW + 2))
    store.record("a:1", failed(NOW + 4, "connect: refused"))
    assert store.observations(["a:1"]) == {
        "a:1": Observation(Sample(NOW, {"gpu_mem_pct": 40.0}), error="connect: refused",
                           first_seen=NOW, failures=2)
    }


def test_store_success_replaces_sample_and_clears_error() -> None:
    store = TelemetryStore()
    store.record("a:1", ok(40.0, NOW))
    store.record("a:1", failed(NOW + 2))
    store.record("a:1", ok(90.0, NOW + 4))
    assert store.observations(["a:1"])["a:1"] == Observation(
        Sample(NOW + 4, {"gpu_mem_pct": 90.0}), first_seen=NOW)


def test_store_failure_before_any_success_and_unknown_addresses() -> None:
    store = TelemetryStore()
    store.record("a:1", failed(NOW, "http: status 500"))
    assert store.observations(["a:1", "b:1"]) == {
        "a:1": Observation(sample=None, error="http: status 500", first_seen=NOW, failures=1),
        "b:1": Observation(sample=None, error=None),
    }


def test_store_copies_signals() -> None:
    store = TelemetryStore()
    result = ok(10.0, NOW)
    store.record("a:1", result)
    assert result.signals is not None
    result.signals["gpu_mem_pct"] = 99.0
    sample = store.observations(["a:1"])["a:1"].sample
    assert sample is not None and sample.signals["gpu_mem_pct"] == 10.0


def test_store_forget_drops_unconfigured_endpoints() -> None:
    store = TelemetryStore()
    for address in ("a:1", "b:1", "c:1"):
        store.record(address, ok(10.0, NOW))
    store.forget({"b:1"})
    observations = store.observations(["a:1", "b:1", "c:1"])
    assert observations["b:1"].sample is not None
    assert observations["a:1"].sample is None and observations["c:1"].sample is None


def test_off_loop_pauses_the_cyclic_gc_while_its_job_runs() -> None:
    """A collection holds the GIL whichever thread runs it; the worker's jobs must not set
    one off mid-job (the loop would wait for it). The collector's state is restored after."""
    import gc

    def job(fail: bool) -> tuple[bool, str]:
        if fail:
            raise RuntimeError("boom")
        return gc.isenabled(), threading.current_thread().name

    async def scenario() -> tuple[bool, str]:
        with pytest.raises(RuntimeError):
            await worker.off_loop(job, True)
        assert gc.isenabled()
        return await worker.off_loop(job, False)

    assert gc.isenabled()
    enabled_inside, thread = asyncio.run(scenario())
    assert not enabled_inside and thread.startswith("trimtab-telemetry")
    assert gc.isenabled()
