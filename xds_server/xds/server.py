"""grpc.aio servicers: they only pump messages between gRPC and the sans-IO stream machines,
and tell the stream observers (`xds.observers`) what happened.

Per stream: a reader task moves requests into the stream's `Inbox` (bounded: while it is full
the stream stops reading, so gRPC's flow control pushes back on the client); the pump hands
each request to the machine (`receive()`, which returns events), asks it what to send for the
latest snapshot (`responses()`) and writes those. Everything else (metrics, the push and NACK
logs, convergence, heap trimming, the admin API's NACK log) is an observer; a failing
observer is logged and counted, and never breaks a stream (`observers.base.Observers`).

Responses leave as pre-encoded bytes (identity serializer): each resource is encoded once per
version (see `snapshot.Resource`) and shared by every stream; only version and nonce are added
per response. Requests are parsed with the generated upb classes.

Limits (`protocol.StreamLimits`, from `xds.limits`): a request naming more resources than
`max_resource_names`, or over the stream's subscription byte budget, ends its stream with
RESOURCE_EXHAUSTED; one with a peer string over its bound (`FieldTooLarge`) or otherwise
breaking the protocol, with INVALID_ARGUMENT; no response exceeds
`max_response_bytes` (the machines split pushes into parts, and withhold what cannot fit,
which the stream log reports as our error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.security.guard import Denied, XdsGuard
from xds_server.xds import encode as wire
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.heap import HeapTrimmer
from xds_server.xds.observers.base import EventCallback, Observers, Sent, StreamObserver
from xds_server.xds.observers.convergence import ConvergenceObserver
from xds_server.xds.observers.metrics import StreamMetrics
from xds_server.xds.observers.push_log import PushLog
from xds_server.xds.observers.stream_log import StreamLog
from xds_server.xds.protocol import (
    DeltaStream,
    Event,
    ProtocolError,
    ResourceLimitExceeded,
    Response,
    SotwStream,
    StreamLimits,
)
from xds_server.xds.stream_info import Inbox, StreamInfo

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


class XdsServicer:
    """Serves ADS and the per-type services, SotW and Delta, from one SnapshotCache.

    The standard observers (stream metrics, stream log, convergence, push log, heap trimmer)
    come first; `observers` (e.g. the admin API's `NackLog`) and `on_event` (a function
    given every event) follow, in that order."""

    def __init__(self, cache: SnapshotCache,
                 on_event: Callable[[StreamInfo, Event], None] | None = None,
                 guard: XdsGuard | None = None, limits: StreamLimits | None = None,
                 observers: Iterable[StreamObserver] = ()) -> None:
        self.cache = cache
        self.guard = guard
        self.limits = limits if limits is not None else StreamLimits()
        self.closing = False
        self.streams: set[StreamInfo] = set()
        self.heap = HeapTrimmer()
        self.push_log = PushLog()
        self.observers = Observers([StreamMetrics(), StreamLog(),
                                    ConvergenceObserver(cache.convergence), self.push_log,
                                    self.heap, *observers])
        if on_event is not None:
            self.observers.add(EventCallback(on_event))

    def subscribers(self, type_url: str) -> int:
        """How many distinct nodes hold a stream subscribed to `type_url` (e.g. the Envoys
        that share an admission budget, each counting only its own requests)."""
        return len({info.node_id for info in self.streams if type_url in info.types})

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
                              self.guard.open(context) if self.guard is not None else None)
            await self._serve(info, requests, context)
        return handle

    async def _serve(self, info: StreamInfo, requests: AsyncIterator,
                     context: grpc.aio.ServicerContext) -> None:
        wake = info.wake = asyncio.Event()
        inbox = info.inbox
        unwatch = self.cache.watch_event(wake)
        reader = asyncio.create_task(self._read(requests, inbox, wake))
        self.streams.add(info)
        self.observers.on_open(info)
        try:
            await self._pump(info, inbox, wake, reader, context)
        except ResourceLimitExceeded as exc:
            self.observers.on_error(info, exc)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ProtocolError as exc:
            self.observers.on_error(info, exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Denied as exc:  # the guard has logged and counted it
            await context.abort(exc.code, exc.reason)
        finally:
            unwatch()
            reader.cancel()
            self.streams.discard(info)
            self.observers.on_close(info)

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
                self.observers.on_withheld(info, notice)
            for response in responses:
                await self._send(info, response, context)

    def _receive(self, info: StreamInfo, request: object) -> None:
        machine = info.machine
        if self.guard is not None and info.access is not None:
            self.guard.on_request(info.access)
        events = machine.receive(request)  # type: ignore[arg-type]
        if self.guard is not None and info.access is not None:
            self.guard.admit(info.access, machine.node)
        for type_url in machine.types.keys() - info.types:
            info.types.add(type_url)
            self.observers.on_subscribe(info, type_url)
        for event in events:
            self.observers.on_event(info, event)

    async def _send(self, info: StreamInfo, response: Response,
                    context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        data = encode_sotw(response) if info.api == "sotw" else encode_delta(response)
        await context.write(data)
        self.observers.on_sent(info, Sent(response, len(data), time.perf_counter() - started))


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
