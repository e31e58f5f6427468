"""One simulated vLLM server: the OpenAI HTTP API, /metrics and ORCA headers over an Engine.

Wire behaviour follows vLLM's OpenAI-compatible server:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``; ``stream: true`` answers with
  Server-Sent Events, one ``data: {json}`` chunk per token in OpenAI's chunk shape, then
  ``data: [DONE]``; otherwise one JSON body with ``usage``. Output length is ``max_tokens``
  (finish_reason ``length``, as with ``ignore_eos``). Default ``max_tokens``: 16 for
  completions (OpenAI's default), 256 for chat (vLLM would use the rest of the context).
* Prompt size: the ``prompt_tokens`` field when present (our load generator sends it), else
  the prompt or message text length / 4.
* Errors use vLLM's error body: 400 for a prompt that does not fit ``max_model_len``, 404 for
  an unknown model. A server still in ``cold_start_s`` answers 503 everywhere except
  ``/sim/stats``.
* ``GET /metrics``: vLLM's metric names plus the DCGM exporter's for the simulated GPU.
* Every /v1 response carries ``endpoint-load-metrics`` in ORCA TEXT form (see
  :func:`orca_header`), which Envoy's client_side_weighted_round_robin reads.
* ``x-sim-server: <name>`` names the backend that answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from trimtab_dev.sim.engine import Engine, SimRequest
from trimtab_dev.sim.exposition import MetricsCollector, orca_header
from trimtab_dev.sim.openai import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChunkWriter,
    include_usage,
    read_prompt_tokens,
    unary_body,
)
from trimtab_dev.sim.profiles import Efficiency, GpuProfile, ModelProfile

log = logging.getLogger(__name__)

ORCA_HEADER = "endpoint-load-metrics"
SERVER_HEADER = "x-sim-server"
MAX_STEP_DEBT_S = 0.002  # how far a late step may start in the past to keep the pace
SHUTDOWN_TIMEOUT_S = 0.5  # a stopped server does not wait for its handlers


@dataclass(frozen=True)
class Faults:
    """Injected faults: ``slow`` multiplies step times, ``dead`` leaves the port closed
    (connection refused), ``cold_start_s`` answers 503 until that many seconds have passed."""

    slow: float = 1.0
    dead: bool = False
    cold_start_s: float = 0.0


@dataclass(frozen=True)
class ServerConfig:
    name: str
    gpu: GpuProfile
    model: ModelProfile
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 0
    faults: Faults = Faults()
    efficiency: Efficiency = Efficiency()
    max_model_len: int | None = None
    orca: bool = True
    orca_utilization: str = "occupancy"  # see ORCA_UTILIZATION


class _Client:
    """The HTTP side of one request: woken whenever its request emits a token."""

    __slots__ = ("event", "sent")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.sent = 0


class SimServer:
    """One simulated model server on its own loopback port."""

    def __init__(self, config: ServerConfig,
                 stats_provider: Callable[[], dict] | None = None) -> None:
        self.config = config
        self.port = config.port
        self.uuid = "GPU-" + str(uuid.uuid5(uuid.NAMESPACE_URL, f"trimtab-sim/{config.name}"))
        self.in_flight = 0
        self.errors: list[float] = []
        self._stats_provider = stats_provider or (lambda: {})
        self._clients: dict[SimRequest, _Client] = {}
        self._runner: web.AppRunner | None = None
        self._driver: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._warm_at = 0.0
        self._seq = 0
        self.engine = self._new_engine()

    # ---- lifecycle --------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def alive(self) -> bool:
        return self._runner is not None

    def _new_engine(self) -> Engine:
        c = self.config
        loop_time = asyncio.get_running_loop().time
        return Engine(c.gpu, c.model, c.efficiency, clock=loop_time, slow=c.faults.slow,
                      max_model_len=c.max_model_len)

    async def start(self) -> None:
        """Bind the port (or, when dead, only pick one) and start the engine loop."""
        if self.config.faults.dead:
            if self.port == 0:
                self.port = _free_port(self.config.host)
            return
        await self.revive(cold_start_s=self.config.faults.cold_start_s)

    async def revive(self, cold_start_s: float = 0.0) -> None:
        """(Re)start serving with a fresh engine, as a restarted vLLM process would."""
        if self._runner is not None:
            return
        loop = asyncio.get_running_loop()
        self.engine = self._new_engine()
        self._warm_at = loop.time() + cold_start_s
        runner = web.AppRunner(self._build_app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.port, reuse_address=True)
        await site.start()
        self._runner = runner
        if self.port == 0:
            self.port = _bound_port(runner)
        self._driver = asyncio.create_task(self._drive(), name=f"sim-{self.config.name}")

    async def stop(self) -> None:
        """Close the port and drop every request, as a crashed server would."""
        runner, self._runner = self._runner, None
        if self._driver is not None:
            self._driver.cancel()
            await asyncio.gather(self._driver, return_exceptions=True)
            self._driver = None
        for req, client in list(self._clients.items()):
            self.engine.abort(req)
            client.event.set()
        if runner is not None:
            await runner.cleanup()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/stats", self._sim_stats)
        return app

    # ---- engine loop ------------------------------------------------------------------
    async def _drive(self) -> None:
        """Run engine steps back to back in real time while there is work."""
        try:
            await self._steps()
        except Exception:
            log.exception("engine loop of %s failed", self.config.name)
            raise

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        prev_end: float | None = None
        while True:
            now = loop.time()
            start = now if prev_end is None else max(prev_end, now - MAX_STEP_DEBT_S)
            plan = self.engine.plan_step(now=start)
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                prev_end = None
                continue
            end = start + plan.duration
            delay = end - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            result = self.engine.finish_step(plan, now=end)
            for req in result.emitted:
                client = self._clients.get(req)
                if client is not None:
                    client.event.set()
            prev_end = end

    # ---- handlers ---------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.in_flight += 1
        try:
            parsed = await self._admit(request, chat)
            if isinstance(parsed, web.Response):
                self._count_error(parsed.status)
                return parsed
            req, body = parsed
            if body.get("stream"):
                return await self._stream(request, req, body, chat)
            return await self._unary(req, body, chat)
        finally:
            self.in_flight -= 1

    async def _admit(self, request: web.Request,
                     chat: bool) -> web.Response | tuple[SimRequest, dict]:
        """Validate the body; on success queue the request in the engine."""
        if not self._warm():
            return self._error(503, "ServiceUnavailableError", "server is starting up")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            prompt_tokens = read_prompt_tokens(body, chat)
            default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens")
                             or default)
        except (ValueError, TypeError) as exc:
            return self._error(400, "BadRequestError", f"invalid request: {exc}")
        model = body.get("model", self.config.served_model_name)
        if model != self.config.served_model_name:
            return self._error(404, "NotFoundError", f"The model `{model}` does not exist.")
        problem = self.engine.validate(prompt_tokens, max_tokens)
        if problem is not None:
            return self._error(400, "BadRequestError", problem)
        await asyncio.sleep(self.config.efficiency.api_overhead_s)  # HTTP + tokenizer
        if not self.alive:
            return self._error(503, "ServiceUnavailableError", "server stopped")
        self._seq += 1
        req = SimRequest(f"{self.config.name}-{self._seq}", prompt_tokens, max_tokens)
        self._clients[req] = _Client()
        self.engine.submit(req)
        self._wake.set()
        return req, body

    async def _stream(self, request: web.Request, req: SimRequest, body: dict,
                      chat: bool) -> web.StreamResponse:
        client = self._clients[req]
        chunks = ChunkWriter(req, self.config.served_model_name, chat,
                              include_usage(body))
        resp = web.StreamResponse(headers=self._headers("text/event-stream"))
        try:
            await resp.prepare(request)
            while req.finished_at is None:
                await client.event.wait()
                client.event.clear()
                if req.aborted:  # the server was stopped: cut the connection mid-stream
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                new = req.generated - client.sent
                if new > 0:
                    client.sent = req.generated
                    await resp.write(chunks.tokens(new, done=req.finished_at is not None))
            await resp.write(chunks.trailer())
            await resp.write_eof()
            return resp
        finally:
            self._release(req)

    async def _unary(self, req: SimRequest, body: dict, chat: bool) -> web.Response:
        client = self._clients[req]
        try:
            while req.finished_at is None:
                await client.event.wait()
                client.event.clear()
                if req.aborted:
                    return self._error(503, "ServiceUnavailableError", "server stopped")
            payload = unary_body(req, self.config.served_model_name, chat)
            return web.Response(body=json.dumps(payload).encode(),
                                headers=self._headers("application/json"))
        finally:
            self._release(req)

    def _release(self, req: SimRequest) -> None:
        self._clients.pop(req, None)
        if not req.done:
            self.engine.abort(req)

    async def _models(self, request: web.Request) -> web.Response:
        if not self._warm():
            return self._error(503, "ServiceUnavailableError", "server is starting up")
        name = self.config.served_model_name
        card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": name, "parent": None, "max_model_len": self.engine.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self._warm() else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._warm():
            return web.Response(status=503, text="server is starting up\n")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MetricsCollector(self))
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _sim_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self._stats_provider())

    # ---- helpers ----------------------------------------------------------------------
    def _warm(self) -> bool:
        return asyncio.get_running_loop().time() >= self._warm_at

    def _count_error(self, status: int) -> None:
        if status >= 500 or status == 429:
            self.errors.append(asyncio.get_running_loop().time())

    def error_rate(self, window: float = 10.0) -> float:
        now = asyncio.get_running_loop().time()
        self.errors = [t for t in self.errors if t > now - window]
        return len(self.errors) / window

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Content-Type": content_type, SERVER_HEADER: self.config.name}
        if self.config.orca:
            headers[ORCA_HEADER] = orca_header(self)
        return headers

    def _error(self, status: int, kind: str, message: str) -> web.Response:
        body = {"object": "error", "message": message, "type": kind, "param": None,
                "code": status}
        return web.Response(status=status, body=json.dumps(body).encode(),
                            headers=self._headers("application/json"))

    def snapshot(self) -> dict[str, Any]:
        e = self.engine
        return {"name": self.config.name, "gpu": self.config.gpu.name, "alive": self.alive,
                "in_flight": self.in_flight, "running": e.num_running,
                "waiting": e.num_waiting, "kv_usage": round(e.kv_usage, 4),
                "preemptions": e.stats.preemptions, "completed": e.stats.success}


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bound_port(runner: web.AppRunner) -> int:
    for addr in runner.addresses:
        return int(addr[1])
    raise RuntimeError("server bound no address")
