"""Tiny stand-ins for GPU model servers, for the demo and the benchmarks.

Each backend answers any request with JSON ``{"backend": "host:port", "model": ...}`` and
serves ``GET /metrics`` as a DCGM exporter would (framebuffer used/free for GPU 0), with a
memory figure that can be changed at run time. `DemoBackends` runs several of them on one
background thread with its own event loop; its setters are thread-safe.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TOTAL_MIB = 81_559  # an 80 GB H100


@dataclass
class FakeGpuServer:
    """State of one backend; read and written under `lock`."""

    host: str
    port: int
    used_mib: int = 0
    total_mib: int = TOTAL_MIB
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def metrics_text(self) -> str:
        with self.lock:
            used, free = self.used_mib, max(self.total_mib - self.used_mib, 0)
        labels = f'gpu="0",UUID="GPU-demo-{self.port}",device="nvidia0",Hostname="demo-{self.port}"'
        lines = []
        for name, help_text, value in (("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", free),
                                       ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", used)):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name}{{{labels}}} {value}"]
        return "\n".join(lines) + "\n"


def _app(server: FakeGpuServer) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=server.metrics_text(), content_type="text/plain")

    async def answer(request: web.Request) -> web.Response:
        try:
            body: Any = json.loads(await request.read() or b"{}")
        except ValueError:
            body = {}
        with server.lock:
            server.requests += 1
        model = body.get("model") if isinstance(body, dict) else None
        return web.json_response({"backend": server.address, "model": model})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


class DemoBackends:
    """Fake GPU servers on the given ports (0: any free port)."""

    def __init__(self, ports: Sequence[int], host: str = "127.0.0.1") -> None:
        self.servers = [FakeGpuServer(host, port) for port in ports]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runners: list[web.AppRunner] = []

    def start(self, timeout: float = 10.0) -> DemoBackends:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="demo-backends",
                                        daemon=True)
        self._thread.start()
        try:
            self._call(self._start_all(), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is None or self._thread is None:
            return
        try:
            self._call(self._stop_all(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()
            self._loop, self._thread = None, None

    def __enter__(self) -> DemoBackends:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Awaitable[Any], timeout: float) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    async def _start_all(self) -> None:
        for server in self.servers:
            runner = web.AppRunner(_app(server), access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, server.host, server.port).start()
            server.port = int(runner.addresses[0][1])

    async def _stop_all(self) -> None:
        runners, self._runners = self._runners, []
        await asyncio.gather(*(runner.cleanup() for runner in runners), return_exceptions=True)

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]

    def set_used_pct(self, index: int, pct: float) -> None:
        """Report `pct` percent of the framebuffer as used by backend `index`."""
        server = self.servers[index]
        with server.lock:
            server.used_mib = round(server.total_mib * min(max(pct, 0.0), 100.0) / 100)

    def used_pct(self, index: int) -> float:
        server = self.servers[index]
        with server.lock:
            return 100.0 * server.used_mib / server.total_mib

    def request_counts(self) -> list[int]:
        counts = []
        for server in self.servers:
            with server.lock:
                counts.append(server.requests)
        return counts
