"""Fake model servers for integration tests and the demo.

Each backend is an aiohttp app that answers ANY method/path with JSON
``{"backend": "host:port", "method": ..., "path": ..., "model": ...}`` (or, when the
JSON body has ``"stream": true``, the same object as OpenAI-style SSE chunks) and serves
``GET /metrics`` in DCGM-exporter text format with run-time mutable values.
A :class:`BackendFleet` runs N of them on free 127.0.0.1 ports in one
background thread with its own asyncio loop; all setters are thread-safe.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

MetricsMode = Literal["ok", "garbage", "hang", "error"]
_HANG_POLL_S = 0.05


@dataclass
class Backend:
    """State of one fake model server. Read and written under ``lock``."""

    gpu_uuid: str = field(default_factory=lambda: f"GPU-{uuid.uuid4()}")
    used_mib: int = 1000
    total_mib: int = 81559
    gpu_util: int = 0
    metrics_mode: MetricsMode = "ok"
    stream_chunks: int = 3
    chunk_delay_s: float = 0.0
    requests: int = 0
    scrapes: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics_text(self) -> str:
        """DCGM-exporter exposition for GPU 0."""
        with self.lock:
            used, free = self.used_mib, max(self.total_mib - self.used_mib, 0)
            util = self.gpu_util
        labels = (
            f'gpu="0",UUID="{self.gpu_uuid}",pci_bus_id="00000000:00:04.0",'
            f'device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="fake-{self.port}"'
        )
        rows = [
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", free),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", used),
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", util),
        ]
        lines: list[str] = []
        for name, help_text, value in rows:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} gauge",
                f"{name}{{{labels}}} {value}",
            ]
        return "\n".join(lines) + "\n"


def _json_of(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


async def _stream_sse(
    request: web.Request, backend: Backend, payload: dict[str, Any]
) -> web.StreamResponse:
    """OpenAI-style SSE: ``stream_chunks`` events ``chunk_delay_s`` apart, then ``[DONE]``."""
    resp = web.StreamResponse(
        headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
    )
    await resp.prepare(request)
    with backend.lock:
        chunks, delay = backend.stream_chunks, backend.chunk_delay_s
    try:
        for index in range(chunks):
            if index and delay:
                await asyncio.sleep(delay)
            await resp.write(f"data: {json.dumps({**payload, 'chunk': index})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:  # the proxy or client went away mid-stream
        pass
    return resp


def _make_app(backend: Backend, stopping: threading.Event) -> web.Application:
    async def metrics(request: web.Request) -> web.StreamResponse:
        with backend.lock:
            backend.scrapes += 1
        while backend.metrics_mode == "hang" and not stopping.is_set():
            await asyncio.sleep(_HANG_POLL_S)
        mode = backend.metrics_mode
        if mode == "garbage":
            return web.Response(text="\x00garbage{{{ not prometheus\nDCGM_FI_DEV_FB_USED{ oops\n")
        if mode == "error":
            return web.Response(status=500, text="internal error\n")
        return web.Response(text=backend.metrics_text(), content_type="text/plain", charset="utf-8")

    async def echo(request: web.Request) -> web.StreamResponse:
        body = _json_of(await request.read())
        with backend.lock:
            backend.requests += 1
        payload = {
            "backend": backend.address,
            "method": request.method,
            "path": request.path_qs,
            "model": body.get("model"),
        }
        if body.get("stream") is True:
            return await _stream_sse(request, backend, payload)
        return web.json_response(payload)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@dataclass
class BackendFleet:
    """N fake model servers on free 127.0.0.1 ports, served from a background thread."""

    count: int = 2
    host: str = "127.0.0.1"
    backends: list[Backend] = field(default_factory=list, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _runners: list[web.AppRunner] = field(default_factory=list, init=False, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 10.0) -> BackendFleet:
        if self._thread is not None:
            raise RuntimeError("fleet already started")
        self._stopping.clear()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="backend-fleet", daemon=True
        )
        self._thread.start()
        self._call(self._start_all(), timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._stopping.set()
        try:
            self._call(self._stop_all(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()
            self._thread, self._loop = None, None

    def __enter__(self) -> BackendFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Awaitable[Any], timeout: float) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    async def _start_all(self) -> None:
        self.backends = []
        for _ in range(self.count):
            backend = Backend(host=self.host)
            runner = web.AppRunner(
                _make_app(backend, self._stopping), access_log=None, shutdown_timeout=0.5
            )
            await runner.setup()
            site = web.TCPSite(runner, self.host, 0)
            await site.start()
            backend.port = int(runner.addresses[0][1])
            self._runners.append(runner)
            self.backends.append(backend)

    async def _stop_all(self) -> None:
        runners, self._runners = self._runners, []
        await asyncio.gather(*(r.cleanup() for r in runners), return_exceptions=True)
        leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    # -- accessors and setters (thread-safe) -------------------------------

    @property
    def addresses(self) -> list[str]:
        """``"127.0.0.1:port"`` of each backend, in order."""
        return [b.address for b in self.backends]

    @property
    def ports(self) -> list[int]:
        return [b.port for b in self.backends]

    def _update(self, index: int, fn: Callable[[Backend], None]) -> None:
        backend = self.backends[index]
        with backend.lock:
            fn(backend)

    def set_memory(self, index: int, used_mib: int, total_mib: int | None = None) -> None:
        """Set FB used (and optionally total) MiB; FB free is reported as total - used."""

        def apply(b: Backend) -> None:
            b.used_mib = int(used_mib)
            if total_mib is not None:
                b.total_mib = int(total_mib)

        self._update(index, apply)

    def set_gpu_util(self, index: int, percent: int) -> None:
        self._update(index, lambda b: setattr(b, "gpu_util", int(percent)))

    def set_metrics_mode(self, index: int, mode: MetricsMode) -> None:
        """``ok``, ``garbage`` (unparseable text), ``hang`` (no answer until reset) or ``error`` (500)."""
        if mode not in ("ok", "garbage", "hang", "error"):
            raise ValueError(f"unknown metrics mode {mode!r}")
        self._update(index, lambda b: setattr(b, "metrics_mode", mode))

    def set_streaming(self, index: int, chunks: int = 3, chunk_delay_s: float = 0.0) -> None:
        """Shape of the SSE answer to requests whose JSON body has ``"stream": true``."""

        def apply(b: Backend) -> None:
            b.stream_chunks, b.chunk_delay_s = int(chunks), float(chunk_delay_s)

        self._update(index, apply)

    def request_count(self, index: int) -> int:
        """Non-``/metrics`` requests served by backend ``index``."""
        with self.backends[index].lock:
            return self.backends[index].requests

    def scrape_count(self, index: int) -> int:
        with self.backends[index].lock:
            return self.backends[index].scrapes

    def request_counts(self) -> dict[str, int]:
        """``{address: requests served}`` for every backend."""
        return {b.address: self.request_count(i) for i, b in enumerate(self.backends)}

    def reset_counts(self) -> None:
        def apply(b: Backend) -> None:
            b.requests, b.scrapes = 0, 0

        for i in range(len(self.backends)):
            self._update(i, apply)
