"""The admin listener's connections, bounded: no client can hold the admin port (or the
process's file descriptors, which xDS needs too) by opening connections and sending nothing.

* A request's header must arrive within ``header_timeout_s`` of the connection opening, or of
  the first byte after the previous response (slowloris); aiohttp has no such timeout.
* A connection with no request in flight is closed after ``idle_timeout_s`` (aiohttp's
  keep-alive timeout is set to it too), and so is one whose client stopped reading.
* At most ``max_per_peer`` connections per client IP and ``max_total`` in all; one over
  either is answered with a JSON 503 naming the limit and closed.
* ``accept()`` failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)
  is logged at most once per ``log_interval_s``, in one line with a count (asyncio logs a
  traceback per failure otherwise).
* The listening socket never sets SO_REUSEPORT: another socket cannot share the port.

Refusals, header timeouts and idle timeouts are each logged at most once per
``log_interval_s`` (whichever client), the line after a quiet spell saying how many were left
out.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from xds_server.admin.encoding import dumps

log = logging.getLogger("trimtab.admin")

RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass(frozen=True)
class ConnectionLimits:
    """What one admin client, and all of them, may hold."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_per_peer: int = 32
    max_total: int = 512
    log_interval_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "idle_timeout_s", "max_per_peer", "max_total",
                     "log_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Throttled:
    """One log line per ``key`` at most every ``interval_s``; the next says how many were
    left out meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._interval, self._clock = logger, interval_s, clock
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def __call__(self, key: str, level: int, message: str) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._skipped[key] += 1
            return
        skipped = self._skipped.pop(key, 0)
        self._last[key] = now
        self._log.log(level, "%s%s", message,
                      f" ({skipped} more like it in the last {self._interval:g} s)"
                      if skipped else "")


class ConnectionGuard:
    """The live admin connections, counted per client IP, and their timeouts."""

    def __init__(self, limits: ConnectionLimits, throttled: Throttled) -> None:
        self.limits = limits
        self.say = throttled
        self.per_peer: Counter[str] = Counter()
        self.total = 0
        self._by_handler: dict[RequestHandler, GuardedConnection] = {}

    def admit(self, peer: str) -> str | None:
        """Count a new connection from ``peer``; or why it is refused (and not counted)."""
        if self.total >= self.limits.max_total:
            return (f"too many admin connections: {self.total} open, the limit is "
                    f"{self.limits.max_total} (max_total); retry later")
        if self.per_peer[peer] >= self.limits.max_per_peer:
            return (f"too many admin connections from {peer}: {self.per_peer[peer]} open, the "
                    f"limit per client is {self.limits.max_per_peer} (max_per_peer); close "
                    f"idle ones")
        self.per_peer[peer] += 1
        self.total += 1
        return None

    def release(self, peer: str) -> None:
        self.total -= 1
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]

    def attach(self, handler: RequestHandler, connection: GuardedConnection) -> None:
        self._by_handler[handler] = connection

    def detach(self, handler: RequestHandler) -> None:
        self._by_handler.pop(handler, None)

    def request_started(self, handler: object) -> None:
        connection = self._by_handler.get(handler)  # type: ignore[call-overload]
        if connection is not None:
            connection.request_started()

    def request_done(self, handler: object) -> None:
        connection = self._by_handler.get(handler)  # type: ignore[call-overload]
        if connection is not None:
            connection.request_done()


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, behind the guard's caps and timeouts."""

    def __init__(self, inner: RequestHandler, guard: ConnectionGuard) -> None:
        self.inner, self.guard = inner, guard
        self.peer = "?"
        self.transport: asyncio.Transport | None = None
        self.admitted = False
        self._in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: str | None = None  # "header" or "idle": what the timer is for

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        refusal = self.guard.admit(self.peer)
        if refusal is not None:
            self.guard.say("refused", logging.WARNING,
                           f"admin connection refused: {refusal}")
            transport.write(_service_unavailable(refusal))
            transport.close()
            return
        self.admitted = True
        self.guard.attach(self.inner, self)
        self.inner.connection_made(transport)
        self._arm(self.guard.limits.header_timeout_s, "header")

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self._in_flight == 0 and self._waiting != "header":  # the next request begins
            self._arm(self.guard.limits.header_timeout_s, "header")
        self.inner.data_received(data)

    def eof_received(self) -> None:
        if self.admitted:
            self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self.admitted:
            self.admitted = False
            self.guard.release(self.peer)
            self.guard.detach(self.inner)
            self.inner.connection_lost(exc)

    def request_started(self) -> None:
        """aiohttp parsed a request's header: no header timeout until its response is made."""
        self._in_flight += 1
        self._cancel()

    def request_done(self) -> None:
        """The handler returned: the connection is idle once its response is written."""
        self._in_flight = max(0, self._in_flight - 1)
        if self._in_flight == 0:
            self._arm(self.guard.limits.idle_timeout_s, "idle")

    def _arm(self, seconds: float, what: str) -> None:
        self._cancel()
        self._waiting = what
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire, what)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._waiting = None, None

    def _expire(self, what: str) -> None:
        self._timer, self._waiting = None, None
        limits = self.guard.limits
        reason = (f"no complete request header within {limits.header_timeout_s:g} s "
                  f"(header_timeout_s)" if what == "header" else
                  f"idle for {limits.idle_timeout_s:g} s (idle_timeout_s)")
        self.guard.say(what, logging.INFO,
                       f"admin connection from {self.peer} closed: {reason}")
        if self.transport is not None:
            self.transport.abort()  # nothing worth flushing: no request, or a reader gone


def _service_unavailable(message: str) -> bytes:
    body = dumps({"error": {"status": 503, "message": message}})
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n")
    return head.encode() + body


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a :class:`ConnectionGuard`; its socket sets
    SO_REUSEADDR (a restart binds at once) and never SO_REUSEPORT (no one shares the port)."""

    __slots__ = ("_host", "_port", "_factory")

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 factory: Callable[[], asyncio.Protocol]) -> None:
        super().__init__(runner)
        self._host, self._port, self._factory = host, port, factory

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._factory, self._host, self._port, backlog=self._backlog,
            reuse_address=True, reuse_port=False)


class GuardedRunner(web.AppRunner):
    """An AppRunner that also puts back the loop's exception handler on cleanup."""

    __slots__ = ("_restore",)

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._restore: Callable[[], None] | None = None

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            if self._restore is not None:
                self._restore()
                self._restore = None


async def start_guarded(app: web.Application, host: str, port: int, limits: ConnectionLimits,
                        http_log: logging.Logger) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` behind ``limits``; ``http_log`` is aiohttp's logger."""
    runner = GuardedRunner(app, access_log=None, logger=http_log,
                           keepalive_timeout=limits.idle_timeout_s)
    await runner.setup()
    server = runner.server
    assert server is not None
    guard = ConnectionGuard(limits, Throttled(log, limits.log_interval_s))
    _hook_requests(server, guard)
    runner._restore = quiet_accept_errors(asyncio.get_running_loop(), guard.say)
    try:
        await GuardedSite(runner, host, port,
                          lambda: GuardedConnection(server(), guard)).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def _hook_requests(server: web.Server, guard: ConnectionGuard) -> None:
    """Tell the guard when aiohttp has parsed a request's header and when its handler is done
    (set before any connection: each connection's handler copies both at creation)."""
    make_request, handle = server.request_factory, server.request_handler

    def request_factory(message: Any, payload: Any, protocol: RequestHandler, writer: Any,
                        task: Any) -> web.BaseRequest:
        guard.request_started(protocol)
        return make_request(message, payload, protocol, writer, task)

    async def request_handler(request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await handle(request)
        finally:
            guard.request_done(request.protocol)

    server.request_factory = request_factory
    server.request_handler = request_handler


Handler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def quiet_accept_errors(loop: asyncio.AbstractEventLoop,
                        say: Callable[[str, int, str], None]) -> Callable[[], None]:
    """Make the loop log running out of descriptors or memory (EMFILE and the like) in one
    throttled line without a traceback; everything else goes to the handler it had. Returns
    what puts that handler back."""
    previous: Handler | None = loop.get_exception_handler()  # type: ignore[assignment]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
            say(f"resources:{exc.errno}", logging.ERROR,
                f"{context.get('message', 'event loop error')}: "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror}); "
                f"connections are refused until descriptors are free")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)  # type: ignore[arg-type]
    return restore

