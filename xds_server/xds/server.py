"""grpc.aio servicers: they only pump messages between gRPC and the sans-IO stream machines.

Responses leave as pre-encoded bytes (identity serializer): each resource is encoded once per
version (see `snapshot.Resource`) and shared by every stream; only version and nonce are added
per response. Requests are parsed with the generated upb classes.

Per push, the labelled metric children are looked up once per (type, API). Each push gets one
info line while at most `PER_PUSH_LOG_STREAMS` streams are open; above that, per-push lines go to
debug and info summarises the pushes per type once per `PushLog` window (1 s), so 1,000 streams
make a handful of lines per tick, not 1,000.

Limits (`protocol.StreamLimits`, from `xds.limits`): a request naming more resources than
`max_resource_names` ends its stream with RESOURCE_EXHAUSTED; no response exceeds
`max_response_bytes` (the machines split pushes into parts, and withhold what cannot fit,
which is logged here as our error).

Memory: what a stream subscribed to is held by its machine only, and freed when it closes. After
streams that held many names close, `HeapTrimmer` hands the freed heap back to the OS (glibc
keeps freed small blocks otherwise, and RSS would stay at its peak).

Inbound backpressure: a stream holds at most `INBOX_LIMIT` requests read but not yet handled.
While its `Inbox` is full (the pump is blocked writing to a client that does not read) the
stream stops reading, so gRPC's flow control pushes back on the client instead of requests
piling up in memory.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.admin import metrics
from xds_server.security.guard import Denied, StreamAccess, XdsGuard
from xds_server.xds import encode as wire
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.convergence import StreamConvergence
from xds_server.xds.protocol import (
    Ack,
    DeltaStream,
    Event,
    Nack,
    ProtocolError,
    ResourceLimitExceeded,
    Response,
    SotwStream,
    StaleNonce,
    StreamLimits,
    Withheld,
)

log = logging.getLogger("trimtab.xds")

_SERVICES: dict[str, tuple[str, str, str | None]] = {
    # service name: (SotW method, Delta method, type URL or None for ADS)
    "envoy.service.discovery.v3.AggregatedDiscoveryService":
        ("StreamAggregatedResources", "DeltaAggregatedResources", None),
    "envoy.service.cluster.v3.ClusterDiscoveryService":
        ("StreamClusters", "DeltaClusters", type_urls.CLUSTER),
    "envoy.service.endpoint.v3.EndpointDiscoveryService":
        ("StreamEndpoints", "DeltaEndpoints", type_urls.ENDPOINT),
    "envoy.service.listener.v3.ListenerDiscoveryService":
        ("StreamListeners", "DeltaListeners", type_urls.LISTENER),
    "envoy.service.route.v3.RouteDiscoveryService":
        ("StreamRoutes", "DeltaRoutes", type_urls.ROUTE),
}


def _identity(data: bytes) -> bytes:
    return data


def encode_sotw(response: Response) -> bytes:
    return wire.sotw_response(response.version, (r.sotw_field for r in response.resources),
                              response.type_url, response.nonce)


def encode_delta(response: Response) -> bytes:
    return wire.delta_response(response.version, (r.delta_field for r in response.resources),
                               response.type_url, response.nonce, response.removed)


PER_PUSH_LOG_STREAMS = 64  # above this many open streams, pushes are logged in summary
INBOX_LIMIT = 64  # requests read from a stream and not yet handled
WITHHELD_LOGGED = 1024  # (type, version, names) withheld notices remembered, to log each once


class Inbox:
    """A stream's requests read and not yet handled, at most `limit` of them; then `None`
    once, the end of the stream (which never waits, so it may be one over `limit`)."""

    def __init__(self, limit: int = INBOX_LIMIT) -> None:
        self.limit = limit
        self.max_seen = 0  # the most requests it ever held (the end-of-stream mark not counted)
        self._items: deque = deque()
        self._space = asyncio.Event()

    async def put(self, request: object) -> None:
        """Add `request`, first waiting while the inbox is full."""
        while len(self._items) >= self.limit:
            self._space.clear()
            await self._space.wait()
        self._items.append(request)
        self.max_seen = max(self.max_seen, len(self._items))

    def end(self) -> None:
        self._items.append(None)

    def popleft(self) -> object:
        request = self._items.popleft()
        self._space.set()
        return request

    def __len__(self) -> int:
        return len(self._items)


TRIM_AFTER_NAMES = 10_000  # names held by streams closed since the last trim that call for one
TRIM_DELAY_S = 0.5  # closes within this long share one trim


@cache
def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    for name in ("libc.so.6", ctypes.util.find_library("c")):
        if name is None:
            continue
        try:
            trim = ctypes.CDLL(name).malloc_trim
        except (OSError, AttributeError):
            continue
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return trim  # type: ignore[no-any-return]
    return None


class HeapTrimmer:
    """Returns freed heap memory to the OS once streams holding at least `min_names`
    subscribed or sent names (together) have closed: at most one trim per `delay_s`, run in a
    worker thread (ctypes releases the GIL), so serving never waits for it."""

    def __init__(self, min_names: int = TRIM_AFTER_NAMES, delay_s: float = TRIM_DELAY_S,
                 trim: Callable[[int], int] | None = None) -> None:
        self.min_names = min_names
        self.delay_s = delay_s
        self.trims = 0  # completed
        self.last_seconds = 0.0  # how long the last trim took (in its worker thread)
        self._trim = trim if trim is not None else _load_malloc_trim()
        self._pending = 0
        self._timer: asyncio.TimerHandle | None = None

    def closed(self, names: int) -> None:
        """A stream that held `names` names has ended."""
        self._pending += names
        if self._trim is None or self._timer is not None or self._pending < self.min_names:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.delay_s, self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._pending = None, 0
        loop.run_in_executor(None, self._run).add_done_callback(self._done)

    def _run(self) -> float:
        started = time.perf_counter()
        assert self._trim is not None
        self._trim(0)
        return time.perf_counter() - started

    def _done(self, future: asyncio.Future) -> None:
        self.trims += 1
        if future.exception() is None:
            self.last_seconds = future.result()
            log.debug("returned freed heap memory to the OS in %.3f s", self.last_seconds)


def held_names(machine: SotwStream | DeltaStream) -> int:
    """How many names a stream's machine holds (subscribed and sent), all types together."""
    return sum(len(st.names) + len(st.sent) for st in machine.types.values())


@dataclass(frozen=True)
class _PushMetrics:
    """The push metrics' labelled children for one (type, API)."""

    pushes: Any
    resources: Any
    bytes: Any
    seconds: Any


@lru_cache(maxsize=64)
def _push_metrics(kind: str, api: str) -> _PushMetrics:
    return _PushMetrics(metrics.PUSHES.labels(type=kind, api=api),
                        metrics.PUSH_RESOURCES.labels(type=kind),
                        metrics.PUSH_BYTES.labels(type=kind),
                        metrics.PUSH_SECONDS.labels(type=kind))


@dataclass
class _PushTally:
    responses: int = 0
    resources: int = 0
    removed: int = 0
    bytes: int = 0
    versions: set[str] = field(default_factory=set)


class PushLog:
    """The info-level push log: per (type, API), one line per window summing its pushes."""

    MAX_VERSIONS = 3  # versions named per line

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self._tallies: dict[tuple[str, str], _PushTally] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, kind: str, api: str, response: Response, size: int) -> None:
        tally = self._tallies.get((kind, api))
        if tally is None:
            tally = self._tallies[(kind, api)] = _PushTally()
        tally.responses += 1
        tally.resources += len(response.resources)
        tally.removed += len(response.removed)
        tally.bytes += size
        if len(tally.versions) <= self.MAX_VERSIONS:
            tally.versions.add(response.version)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first push, or a new event loop: the old timer is gone
            self._loop, self._timer = loop, None
        if self._timer is None:
            self._timer = loop.call_later(self.window_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for (kind, api), tally in sorted(self._tallies.items()):
            versions = sorted(tally.versions)[:self.MAX_VERSIONS]
            more = " and more" if len(tally.versions) > self.MAX_VERSIONS else ""
            log.info("pushed %s (%s) %d times within %.1f s: %d resources, %d removed, "
                     "%d bytes; versions %s%s", kind, api, tally.responses, self.window_s,
                     tally.resources, tally.removed, tally.bytes, ", ".join(versions), more)
        self._tallies.clear()


@dataclass(eq=False)
class StreamInfo:
    """What the admin API shows about a connected stream."""

    peer: str
    api: str
    service: str
    machine: SotwStream | DeltaStream
    access: StreamAccess | None = None  # set when the servicer has a guard
    wake: asyncio.Event | None = None
    convergence: StreamConvergence | None = None
    types: set[str] = field(default_factory=set)  # type URLs counted in SUBSCRIPTIONS
    inbox: Inbox = field(default_factory=Inbox)  # requests read, not yet handled

    @property
    def node_id(self) -> str:
        """The node id the stream claimed in its first request (the one it is authorised as)."""
        return self.machine.node.id if self.machine.node is not None else ""

    @property
    def identities(self) -> list[str]:
        """The client certificate's SANs (empty in plaintext, or without a guard)."""
        return list(self.access.identities) if self.access is not None else []


class XdsServicer:
    """Serves ADS and the per-type services, SotW and Delta, from one SnapshotCache."""

    def __init__(self, cache: SnapshotCache,
                 on_event: Callable[[StreamInfo, Event], None] | None = None,
                 guard: XdsGuard | None = None, limits: StreamLimits | None = None) -> None:
        self.cache = cache
        self.guard = guard
        self.limits = limits if limits is not None else StreamLimits()
        self.heap = HeapTrimmer()
        self._withheld_logged: dict[tuple[str, str, str, int], None] = {}
        self.closing = False
        self.on_event = on_event
        self.streams: set[StreamInfo] = set()
        self.push_log = PushLog()

    def close_streams(self) -> None:
        """Shutting down: end every open stream now (clients reconnect, e.g. to a replica)
        instead of letting the server wait out its grace period on streams that never end."""
        self.closing = True
        self.push_log.flush()
        for info in list(self.streams):
            if info.wake is not None:
                info.wake.set()

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        out = []
        for service, (sotw, delta, type_url) in _SERVICES.items():
            methods = {
                sotw: grpc.stream_stream_rpc_method_handler(
                    self._handler("sotw", service, type_url),
                    request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
                    response_serializer=_identity),
                delta: grpc.stream_stream_rpc_method_handler(
                    self._handler("delta", service, type_url),
                    request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
                    response_serializer=_identity),
            }
            out.append(grpc.method_handlers_generic_handler(service, methods))
        return out

    def _handler(self, api: str, service: str, type_url: str | None) -> Callable:
        async def handle(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
            machine: SotwStream | DeltaStream = (
                SotwStream(type_url, self.limits) if api == "sotw"
                else DeltaStream(type_url, self.limits))
            info = StreamInfo(context.peer(), api, service.rsplit(".", 1)[-1], machine,
                              self.guard.open(context) if self.guard is not None else None,
                              convergence=StreamConvergence(self.cache.convergence, api))
            await self._serve(info, requests, context)
        return handle

    async def _serve(self, info: StreamInfo, requests: AsyncIterator,
                     context: grpc.aio.ServicerContext) -> None:
        wake = info.wake = asyncio.Event()
        inbox = info.inbox
        unwatch = self.cache.watch_event(wake)
        reader = asyncio.create_task(self._read(requests, inbox, wake))
        self.streams.add(info)
        metrics.STREAMS.labels(api=info.api).inc()
        try:
            await self._pump(info, inbox, wake, reader, context)
        except ResourceLimitExceeded as exc:
            log.warning("ending stream from %s (node %r): %s", info.peer, info.node_id, exc)
            metrics.PROTOCOL_ERRORS.labels(api=info.api).inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ProtocolError as exc:
            log.warning("protocol error from %s (node %r): %s", info.peer, info.node_id, exc)
            metrics.PROTOCOL_ERRORS.labels(api=info.api).inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Denied as exc:  # the guard has logged and counted it
            await context.abort(exc.code, exc.reason)
        finally:
            unwatch()
            reader.cancel()
            self.streams.discard(info)
            metrics.STREAMS.labels(api=info.api).dec()
            for type_url in info.types:
                metrics.SUBSCRIPTIONS.labels(type=type_urls.short_name(type_url),
                                             api=info.api).dec()
            self.heap.closed(held_names(info.machine))

    @staticmethod
    async def _read(requests: AsyncIterator, inbox: Inbox, wake: asyncio.Event) -> None:
        """Move requests into `inbox`; while it is full, stop reading (flow control)."""
        try:
            async for request in requests:
                await inbox.put(request)
                wake.set()
        except Exception as exc:  # noqa: BLE001 - any read failure just ends the stream
            log.debug("stream closed by peer: %r", exc)
        finally:
            inbox.end()
            wake.set()

    async def _pump(self, info: StreamInfo, inbox: Inbox, wake: asyncio.Event,
                    reader: asyncio.Task, context: grpc.aio.ServicerContext) -> None:
        machine = info.machine
        while True:
            await wake.wait()
            wake.clear()
            if self.closing:
                return
            while inbox:
                request = inbox.popleft()
                if request is None:
                    return
                self._receive(info, request)
                del request  # a parsed request may be megabytes: do not hold it while waiting
            snapshot = self.cache.snapshot
            if self.guard is not None and info.access is not None:
                snapshot = self.guard.view(info.access, snapshot)
            responses = machine.responses(snapshot)
            for notice in machine.take_notices():
                self._log_withheld(info, notice)
            for response in responses:
                await self._send(info, response, context)

    def _log_withheld(self, info: StreamInfo, notice: Withheld) -> None:
        """Our error, logged once per (type, version, names) however many streams hit it."""
        key = (notice.type_url, notice.version, notice.names[0] if notice.names else "",
               len(notice.names))
        if key in self._withheld_logged:
            return
        self._withheld_logged[key] = None
        while len(self._withheld_logged) > WITHHELD_LOGGED:
            del self._withheld_logged[next(iter(self._withheld_logged))]
        names = ", ".join(notice.names[:5]) + (" and more" if len(notice.names) > 5 else "")
        log.error("not sending %s %s (version %s) to %r (logged once for every stream): it "
                  "needs %d bytes, above the %d one response may carry (xds.limits.max_response_bytes "
                  "less headroom; %s); raise it, and the client's receive limit where it has "
                  "one (Envoy: the ADS cluster's envoy_grpc.max_receive_message_length)",
                  type_urls.short_name(notice.type_url), names, notice.version, info.node_id,
                  notice.size, notice.limit,
                  "a whole-state type cannot be split" if len(notice.names) > 1
                  else "one resource cannot be split")

    def _receive(self, info: StreamInfo, request: object) -> None:
        machine = info.machine
        if self.guard is not None and info.access is not None:
            self.guard.on_request(info.access)
        events = machine.receive(request)  # type: ignore[arg-type]
        if self.guard is not None and info.access is not None:
            self.guard.admit(info.access, machine.node)
        for type_url in machine.types.keys() - info.types:
            info.types.add(type_url)
            metrics.SUBSCRIPTIONS.labels(type=type_urls.short_name(type_url), api=info.api).inc()
        for event in events:
            self._observe(info, event)

    def _observe(self, info: StreamInfo, event: Event) -> None:
        kind = type_urls.short_name(event.type_url)
        if isinstance(event, Nack):
            metrics.NACKS.labels(type=kind).inc()
            log.warning("NACK from node %r (peer %s, identity %s) for %s nonce %s (rejected %s): "
                        "%s", info.node_id, info.peer, info.identities or "none", kind,
                        event.nonce, dict(event.rejected), event.detail[:2000])
            if info.convergence is not None:
                info.convergence.nacked(event.nonce)
        elif isinstance(event, Ack):
            metrics.ACKS.labels(type=kind).inc()
            if info.convergence is not None:
                info.convergence.acked(event.type_url, event.nonce, time.monotonic())
        elif isinstance(event, StaleNonce):
            metrics.STALE_NONCES.labels(type=kind).inc()
        if self.on_event is not None:
            self.on_event(info, event)

    async def _send(self, info: StreamInfo, response: Response,
                    context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        data = encode_sotw(response) if info.api == "sotw" else encode_delta(response)
        await context.write(data)
        if info.convergence is not None:
            info.convergence.sent(response.type_url, response.nonce, response.resources)
        kind = type_urls.short_name(response.type_url)
        bound = _push_metrics(kind, info.api)
        bound.pushes.inc()
        bound.resources.inc(len(response.resources))
        bound.bytes.inc(len(data))
        bound.seconds.observe(time.perf_counter() - started)
        self._log_push(info, kind, response, len(data))

    def _log_push(self, info: StreamInfo, kind: str, response: Response, size: int) -> None:
        """One info line per push while at most PER_PUSH_LOG_STREAMS streams are open; above
        that, per-push lines go to debug and info gets one summary per type per second."""
        few = len(self.streams) <= PER_PUSH_LOG_STREAMS
        level = logging.INFO if few else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "push %s v%s nonce %s to %r: %d resources, %d removed", kind,
                    response.version, response.nonce, info.node_id, len(response.resources),
                    len(response.removed))
        if not few and log.isEnabledFor(logging.INFO):
            self.push_log.add(kind, info.api, response, size)


async def start_xds_server(servicer: XdsServicer, address: str,
                           configure: Callable[[grpc.aio.Server], object] | None = None,
                           credentials: grpc.ServerCredentials | None = None,
                           options: list[tuple[str, Any]] | None = None,
                           maximum_concurrent_rpcs: int | None = None,
                           ) -> tuple[grpc.aio.Server, int]:
    """Start serving on `address` (port 0 picks a free port). Returns the server and its port.
    `configure` adds services (health, reflection) before the server starts."""
    server = grpc.aio.server(maximum_concurrent_rpcs=maximum_concurrent_rpcs, options=[*(options or []),
        ("grpc.so_reuseport", 0),  # a second trimtab must fail to bind, not share the port
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ])
    server.add_generic_rpc_handlers(tuple(servicer.handlers()))
    if configure is not None:
        configure(server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind the xDS gRPC server to {address}")
    await server.start()
    return server, port
