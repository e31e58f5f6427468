"""Fake model servers for integration tests and the demo.

Each backend is an aiohttp app that answers ANY method/path with JSON
``{"backend": "host:port", "method": ..., "path": ..., "model": ...}`` (or, when the
JSON body has ``"stream": true``, the same object as OpenAI-style SSE chunks) and serves
``GET /metrics`` in DCGM-exporter text format with run-time mutable values.
A :class:`BackendFleet` runs N of them on free 127.0.0.1 ports in one
background thread with its own asyncio loop; all setters are thread-safe.

Fault and telemetry knobs for routing tests: a live vLLM page (:class:`VllmPage`: KV-cache
gauges, ``vllm:cache_config_info``, TTFT/ITL/e2e histograms and ``http_requests_total{status}``
fed by the requests served), extra exposition text, a forced response status or delay, and
``kill``/``revive`` (listening socket closed, connections cut; reopened on the same port).
With ``health_path`` set, ``GET <health_path>`` answers 200 (while alive) without counting
as a request, so active health checks do not pollute traffic counts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web

MetricsMode = Literal["ok", "garbage", "hang", "error"]
_HANG_POLL_S = 0.05
# vLLM's own bucket bounds (a subset), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass
class VllmPage:
    """What a backend exports in vLLM's metric names next to its DCGM page.

    The gauges are whatever the test sets. Every request the backend answers from then on is
    observed with ``ttft_s`` (and ``itl_s``, when set) in the latency histograms, counted in
    ``vllm:e2e_request_latency_seconds_count`` and in ``http_requests_total{status}``.
    """

    kv_usage: float | None = 0.0
    waiting: int = 0
    running: int = 0
    num_gpu_blocks: int | None = None  # with block_size: vllm:cache_config_info (capacity)
    block_size: int = 16
    ttft_s: float = 0.05
    itl_s: float | None = None
    model: str = "fake-model"
    # The work counters (vllm:prompt_tokens_total, vllm:generation_tokens_total, half each,
    # and vllm:request_success_total at tokens_per_request per request) grow at this many
    # tokens/s of wall time from the first scrape on; None: the page has no such counters.
    tokens_per_s: float | None = None
    tokens_per_request: float = 1000.0


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        rows, running = [f"# TYPE {name} histogram"], 0
        for bound, count in zip((*self.bounds, "+Inf"), counts, strict=True):
            running += count
            rows.append(f'{name}_bucket{{{labels},le="{bound}"}} {running}')
        rows += [f"{name}_count{{{labels}}} {running}", f"{name}_sum{{{labels}}} {self.total}"]
        return rows


@dataclass
class _VllmCounters:
    """Cumulative series a vLLM server keeps; they grow with the requests served."""

    ttft: _Histogram = field(default_factory=lambda: _Histogram(TTFT_BUCKETS))
    itl: _Histogram = field(default_factory=lambda: _Histogram(ITL_BUCKETS))
    e2e: _Histogram = field(default_factory=lambda: _Histogram(()))
    statuses: dict[str, int] = field(default_factory=dict)  # "2xx" / "5xx" -> count
    work_tokens: float = 0.0  # tokens done at the page's tokens_per_s, up to work_stamp
    work_stamp: float | None = None  # time.monotonic() of the last advance

    def advance(self, tokens_per_s: float, now: float) -> float:
        """Tokens done so far, the time since the last call at ``tokens_per_s``."""
        if self.work_stamp is not None:
            self.work_tokens += tokens_per_s * max(0.0, now - self.work_stamp)
        self.work_stamp = now
        return self.work_tokens

    def observe(self, page: VllmPage, status: int) -> None:
        klass = f"{status // 100}xx"
        self.statuses[klass] = self.statuses.get(klass, 0) + 1
        if status >= 500:
            return  # a failed request never produced a token
        self.ttft.observe(page.ttft_s)
        if page.itl_s is not None:
            self.itl.observe(page.itl_s)
        self.e2e.observe(page.ttft_s + (page.itl_s or 0.0))


def vllm_text(page: VllmPage, counters: _VllmCounters | None = None) -> str:
    """Prometheus exposition of ``page`` in vLLM's names (histograms from ``counters``)."""
    counters = counters or _VllmCounters()
    labels = f'model_name="{page.model}"'
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {page.waiting}",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {page.running}",
    ]
    if page.kv_usage is not None:
        lines += ["# TYPE vllm:kv_cache_usage_perc gauge",
                  f"vllm:kv_cache_usage_perc{{{labels}}} {page.kv_usage}"]
    if page.num_gpu_blocks is not None:
        info = f'block_size="{page.block_size}",num_gpu_blocks="{page.num_gpu_blocks}"'
        lines += ["# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1.0"]
    lines += counters.ttft.lines("vllm:time_to_first_token_seconds", labels)
    if page.itl_s is not None:
        lines += counters.itl.lines("vllm:inter_token_latency_seconds", labels)
    lines += counters.e2e.lines("vllm:e2e_request_latency_seconds", labels)
    if page.tokens_per_s is not None:
        work = counters.advance(page.tokens_per_s, time.monotonic())
        for name, value in (("vllm:prompt_tokens_total", work / 2),
                            ("vllm:generation_tokens_total", work / 2),
                            ("vllm:request_success_total", work / page.tokens_per_request)):
            lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {value}"]
    lines.append("# TYPE http_requests_total counter")
    for klass in sorted({"2xx", "5xx", *counters.statuses}):
        lines.append(f'http_requests_total{{handler="/v1/chat/completions",method="POST",'
                     f'status="{klass}"}} {counters.statuses.get(klass, 0)}')
    return "\n".join(lines) + "\n"


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
    health_checks: int = 0
    extra_metrics: str = ""  # appended to the page in mode "ok"
    vllm: VllmPage | None = None  # a live vLLM page next to DCGM (see set_vllm)
    vllm_counters: _VllmCounters = field(default_factory=_VllmCounters, repr=False)
    response_status: int = 200
    status_every: int = 1  # response_status goes to every n-th request; the others get 200
    response_delay_s: float = 0.0
    alive: bool = True
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

    def page_text(self) -> str:
        """The whole ``/metrics`` page in mode ``ok``: DCGM, then vLLM, then the extra text."""
        text = self.metrics_text()
        with self.lock:
            vllm = vllm_text(self.vllm, self.vllm_counters) if self.vllm is not None else ""
            extra = self.extra_metrics
        if extra and not extra.endswith("\n"):
            extra += "\n"
        return text + vllm + extra


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


def _drop_connection(request: web.Request) -> web.HTTPException:
    """A dead server answers nothing: cut the connection (the proxy sees a reset)."""
    if request.transport is not None:
        request.transport.abort()
    return web.HTTPServiceUnavailable()


def _make_app(backend: Backend, stopping: threading.Event,
              health_path: str | None = None) -> web.Application:
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
        return web.Response(text=backend.page_text(), content_type="text/plain", charset="utf-8")

    async def health(request: web.Request) -> web.StreamResponse:
        if not backend.alive:
            raise _drop_connection(request)
        with backend.lock:
            backend.health_checks += 1
        return web.json_response({"status": "ok"})

    async def echo(request: web.Request) -> web.StreamResponse:
        body = _json_of(await request.read())
        if not backend.alive:
            raise _drop_connection(request)
        with backend.lock:
            backend.requests += 1
            status, delay = backend.response_status, backend.response_delay_s
            if backend.requests % backend.status_every:
                status = 200
            if backend.vllm is not None:
                backend.vllm_counters.observe(backend.vllm, status)
        if delay > 0:
            await asyncio.sleep(delay)
        if status != 200:
            return web.json_response({"error": {"message": f"injected status {status}",
                                                "backend": backend.address}}, status=status)
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
    if health_path is not None:
        app.router.add_get(health_path, health)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@dataclass
class BackendFleet:
    """N fake model servers on free 127.0.0.1 ports, served from a background thread."""

    count: int = 2
    host: str = "127.0.0.1"
    health_path: str | None = None  # e.g. "/health": answered apart, not counted as a request
    backends: list[Backend] = field(default_factory=list, init=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    # index-aligned with `backends`; None while that backend is killed
    _runners: list[web.AppRunner | None] = field(default_factory=list, init=False, repr=False)
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

    async def _serve(self, backend: Backend, port: int) -> web.AppRunner:
        app = _make_app(backend, self._stopping, self.health_path)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, port, reuse_address=True)
        await site.start()
        backend.port = int(runner.addresses[0][1])
        return runner

    async def _start_all(self) -> None:
        self.backends = []
        for _ in range(self.count):
            backend = Backend(host=self.host)
            self._runners.append(await self._serve(backend, 0))
            self.backends.append(backend)

    async def _stop_all(self) -> None:
        runners, self._runners = [r for r in self._runners if r is not None], []
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

    def set_extra_metrics(self, index: int, text: str) -> None:
        """Exposition text appended to backend ``index``'s page (mode ``ok``); "" clears it."""
        self._update(index, lambda b: setattr(b, "extra_metrics", str(text)))

    def set_vllm(self, index: int, page: VllmPage | None = None, **changes: Any) -> None:
        """Export a live vLLM page from backend ``index``: ``page`` replaces it (None with no
        ``changes`` removes it); ``changes`` edit the current one (or a new default one).
        The cumulative counters survive edits, as a running server's do."""

        def apply(b: Backend) -> None:
            if page is None and not changes:
                b.vllm = None
                return
            base = page or b.vllm or VllmPage()
            b.vllm = replace(base, **changes)

        self._update(index, apply)

    def vllm_page(self, index: int) -> VllmPage | None:
        with self.backends[index].lock:
            return self.backends[index].vllm

    def set_response_status(self, index: int, status: int = 200, every: int = 1) -> None:
        """Answer every ``every``-th request (not /metrics nor the health path) with
        ``status``, the others with 200; ``every=1``: all of them."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")

        def apply(b: Backend) -> None:
            b.response_status, b.status_every = int(status), int(every)

        self._update(index, apply)

    def set_response_delay(self, index: int, seconds: float = 0.0) -> None:
        """Wait ``seconds`` before answering each request."""
        self._update(index, lambda b: setattr(b, "response_delay_s", float(seconds)))

    def kill(self, index: int, timeout: float = 10.0) -> None:
        """Simulate a dead server: close the listening socket and cut every connection
        (requests in flight are reset). Metrics scrapes fail too. Idempotent."""
        self._update(index, lambda b: setattr(b, "alive", False))
        runner, self._runners[index] = self._runners[index], None
        if runner is not None:
            self._call(runner.cleanup(), timeout)

    def revive(self, index: int, timeout: float = 10.0) -> None:
        """Listen again on the same port after :meth:`kill`. Idempotent."""
        if self._runners[index] is None:
            backend = self.backends[index]
            self._runners[index] = self._call(self._serve(backend, backend.port), timeout)
        self._update(index, lambda b: setattr(b, "alive", True))

    def is_alive(self, index: int) -> bool:
        return self._runners[index] is not None

    def health_check_count(self, index: int) -> int:
        """``GET <health_path>`` requests answered by backend ``index``."""
        with self.backends[index].lock:
            return self.backends[index].health_checks

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
            b.requests, b.scrapes, b.health_checks = 0, 0, 0

        for i in range(len(self.backends)):
            self._update(i, apply)


async def serve_pages(pages: dict[str, str], delay_s: float = 0.0) -> tuple[web.AppRunner, int]:
    """A real aiohttp server on a free loopback port answering GET ``path`` with
    ``pages[path]`` after ``delay_s``; returns the runner (clean up) and the port."""
    async def page(request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(text=pages[request.path])

    app = web.Application()
    for path in pages:
        app.router.add_get(path, page)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]
