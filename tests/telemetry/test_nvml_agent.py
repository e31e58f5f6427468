"""Tests for the NVML metrics agent (no GPU needed: static and fake NVML readers)."""

from __future__ import annotations

import _thread
import asyncio
import os
import signal
import socket
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xds_server.cli import main
from xds_server.telemetry.nvml_agent import (
    GpuStat,
    NvmlUnavailable,
    PynvmlReader,
    StaticReader,
    render,
    serve_agent,
    start_agent,
)
from xds_server.telemetry.parsers import parse_page
from xds_server.telemetry.parsers.reader import MetricsFormatError

H100 = GpuStat(0, "GPU-9c1e6a7d-0000", "NVIDIA H100 80GB HBM3", 20000.0, 61559.0, 35.0)
L4 = GpuStat(1, "GPU-9c1e6a7d-0001", "NVIDIA L4", 18000.0, 4563.0, 97.0)


# --- render ---------------------------------------------------------------------------------


def _gpus(text: str) -> int:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return len(families["DCGM_FI_DEV_FB_USED"].samples)


def test_render_round_trips_through_parse_page_busiest_gpu() -> None:
    text = render([H100, L4]).decode()
    reading = parse_page(text)
    assert reading.gpu_mem_pct == pytest.approx(100 * 18000 / 22563)  # the L4 is the busiest
    assert reading.gpu_util_pct == 97.0 and reading.problems == () and _gpus(text) == 2


def test_render_round_trips_through_parse_page_per_gpu() -> None:
    text = render([H100, L4]).decode()
    h100 = parse_page(text, gpu="0")
    assert h100.server == "dcgm"
    assert h100.gpu_mem_pct == pytest.approx(100 * 20000 / 81559)
    assert h100.gpu_util_pct == 35.0
    assert parse_page(text, uuid=L4.uuid).gpu_util_pct == 97.0


def test_render_labels_and_escaping() -> None:
    odd = GpuStat(3, "GPU-x", 'NVIDIA "Quoted" \\ Name', 1.0, 3.0, 0.0)
    text = render([odd]).decode()
    assert "# TYPE DCGM_FI_DEV_FB_USED gauge" in text
    assert 'gpu="3"' in text and 'UUID="GPU-x"' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    sample = families["DCGM_FI_DEV_FB_FREE"].samples[0]
    assert sample.labels == {"gpu": "3", "UUID": "GPU-x", "modelName": odd.name}
    assert sample.value == 3.0


def test_render_without_gpus_is_a_valid_but_empty_page() -> None:
    text = render([]).decode()
    assert "# HELP DCGM_FI_DEV_FB_USED" in text
    with pytest.raises(MetricsFormatError, match="no recognised model-server or DCGM metrics"):
        parse_page(text)


# --- PynvmlReader with a fake pynvml --------------------------------------------------------


def _fake_pynvml(devices: list[dict[str, Any]], init_error: Exception | None = None) -> Any:
    module = types.ModuleType("pynvml")
    calls: list[str] = []

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    module.nvmlInit = init  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    module.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda i: devices[i]  # type: ignore[attr-defined]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=h["used"], free=h["free"], total=h["used"] + h["free"]
    )
    module.nvmlDeviceGetUUID = lambda h: h["uuid"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetName = lambda h: h["name"]  # type: ignore[attr-defined]
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        gpu=h["util"], memory=0
    )
    module.calls = calls  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = _fake_pynvml(
        [
            # older nvidia-ml-py returns bytes for names/UUIDs, newer returns str
            {
                "used": 20000 * 2**20,
                "free": 61559 * 2**20,
                "uuid": b"GPU-a",
                "name": b"NVIDIA H100",
                "util": 35,
            },
            {"used": 3 * 2**19, "free": 2**20, "uuid": "GPU-b", "name": "NVIDIA L4", "util": 0},
        ]
    )
    monkeypatch.setitem(sys.modules, "pynvml", module)
    yield module


def test_pynvml_reader_maps_nvml_fields(fake_nvml: Any) -> None:
    reader = PynvmlReader()
    assert reader.read() == [
        GpuStat(0, "GPU-a", "NVIDIA H100", 20000.0, 61559.0, 35.0),
        GpuStat(1, "GPU-b", "NVIDIA L4", 1.5, 1.0, 0.0),
    ]
    reader.close()
    assert fake_nvml.calls == ["init", "shutdown"]


def test_pynvml_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable, match="install the nvidia-ml-py package"):
        PynvmlReader()


def test_nvml_init_failure_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = _fake_pynvml([], init_error=OSError("libnvidia-ml.so.1: cannot open shared object"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    with pytest.raises(NvmlUnavailable, match="could not be initialised: libnvidia-ml"):
        PynvmlReader()


# --- the HTTP agent -------------------------------------------------------------------------


class ThreadRecordingReader(StaticReader):
    def __init__(self, stats: list[GpuStat]) -> None:
        super().__init__(stats)
        self.threads: list[int] = []

    def read(self) -> list[GpuStat]:
        self.threads.append(threading.get_ident())
        return super().read()


class FailingReader:
    def read(self) -> list[GpuStat]:
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str, str]:
    async with session.get(url) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


def test_agent_reads_per_request_off_the_event_loop() -> None:
    reader = ThreadRecordingReader([H100])

    async def scenario() -> list[tuple[int, str, str]]:
        runner, port = await start_agent(reader, "127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                first = await _get(session, f"{base}/metrics")
                reader.stats = [H100, L4]
                second = await _get(session, f"{base}/metrics")
                health = await _get(session, f"{base}/healthz")
        finally:
            await runner.cleanup()
        return [first, second, health]

    loop_thread = threading.get_ident()  # asyncio.run runs the loop in this thread
    (s1, ctype, body1), (s2, _, body2), (s3, _, body3) = asyncio.run(scenario())
    assert (s1, s2, s3) == (200, 200, 200)
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype
    assert _gpus(body1) == 1
    assert _gpus(body2) == 2  # a fresh read per request
    assert body3 == "ok\n"
    assert reader.reads == 2
    assert all(t != loop_thread for t in reader.threads)


def test_agent_reports_read_failures_as_503() -> None:
    async def scenario() -> tuple[int, str, str]:
        runner, port = await start_agent(FailingReader(), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await _get(session, f"http://127.0.0.1:{port}/metrics")
        finally:
            await runner.cleanup()

    status, _, body = asyncio.run(scenario())
    assert status == 503
    assert "RuntimeError: NVML_ERROR_GPU_IS_LOST" in body


def test_serve_agent_runs_until_cancelled() -> None:
    async def scenario() -> tuple[int, bool]:
        reader = StaticReader([L4])
        port = _free_port()
        task = asyncio.create_task(serve_agent(reader, "127.0.0.1", port))
        async with aiohttp.ClientSession() as session:
            status = await _retry_get(session, f"http://127.0.0.1:{port}/metrics")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            try:
                await _get(session, f"http://127.0.0.1:{port}/healthz")
                still_up = True
            except aiohttp.ClientConnectionError:
                still_up = False
        return status, still_up

    assert asyncio.run(scenario()) == (200, False)


def _free_port() -> int:
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _retry_get(session: aiohttp.ClientSession, url: str) -> int:
    for _ in range(200):  # the server task needs a few loop turns to bind
        try:
            return (await _get(session, url))[0]
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.01)
    raise AssertionError(f"{url} never answered")


# --- `trimtab agent` --------------------------------------------------------------------------


def _scrape_then_stop(url: str, done: threading.Event, result: dict[str, Any]) -> None:
    """Scrape `url` once it answers, then SIGTERM this process (the agent's handler stops
    it). If it never answers, interrupt the main thread instead (unless `main` returned)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not done.is_set():
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                result["status"], result["page"] = response.status, response.read().decode()
        except OSError:
            time.sleep(0.02)
            continue
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if not done.wait(1):
        _thread.interrupt_main()


def test_cli_agent_serves_dcgm_names_and_closes_nvml_on_sigterm(fake_nvml: Any) -> None:
    port, done, result = _free_port(), threading.Event(), {}
    helper = threading.Thread(target=_scrape_then_stop, daemon=True,
                              args=(f"http://127.0.0.1:{port}/metrics", done, result))
    helper.start()
    try:
        code = main(["agent", "--listen", f"127.0.0.1:{port}"])  # main thread: gets signals
    finally:
        done.set()
        helper.join(10)
    assert code == 0 and result.get("status") == 200, result
    families = {f.name: f for f in text_string_to_metric_families(result["page"])}
    assert {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL"} <= set(families)
    used = {s.labels["UUID"]: s.value for s in families["DCGM_FI_DEV_FB_USED"].samples}
    assert used == {"GPU-a": 20000.0, "GPU-b": 1.5}
    assert fake_nvml.calls == ["init", "shutdown"]  # NVML shut down once the agent stopped
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # its handler is gone again


def test_cli_agent_closes_nvml_when_it_cannot_listen(fake_nvml: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with closing(socket.socket()) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["agent", "--listen", f"127.0.0.1:{port}"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert fake_nvml.calls == ["init", "shutdown"]
