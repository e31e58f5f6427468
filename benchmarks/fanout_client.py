"""Simulated Envoy xDS clients for the fan-out benchmark (and the fan-out fault tests).

Each client opens one ADS stream (SotW or Delta) on its own channel (its own TCP connection,
like one Envoy) and behaves like Envoy: CDS wildcard, EDS for every cluster it learns, LDS,
RDS; every response is ACKed with its nonce; the node is sent on the first request only
(`set_node_on_first_message_only`). Channels accept at most 4 MiB per message, Envoy's default.

Responses are received as raw bytes; only the envelope is parsed (upb), never a resource:
per resource the client reads its name and a cheap key, the version string in Delta, a CRC-32
of the `Any` value in SotW (whose name it reads from the value's first field). A worker process runs many clients on one
event loop and reports, per published tick, when each client held every changed
ClusterLoadAssignment (`Tracker`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import resource
import time
import zlib
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.service.discovery.v3 import discovery_pb2

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
ENVOY_MAX_RECEIVE = 4 * 1024 * 1024  # Envoy's gRPC client default per message
Key = str | int  # Delta: the resource version; SotW: CRC-32 of the Any value


# --- the wire: parse the envelope (upb), never the resources themselves ----------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def resource_name(value: bytes) -> str:
    """Field 1 of a serialised resource (`name` / `cluster_name` in every xDS resource trimtab
    sends; deterministic serialisation writes it first) without parsing the rest."""
    pos = 0
    while pos < len(value):
        key, pos = _varint(value, pos)
        if key & 7 == 0:
            _, pos = _varint(value, pos)
            continue
        if key & 7 != 2:
            break
        size, pos = _varint(value, pos)
        if key >> 3 == 1:
            return value[pos:pos + size].decode()
        pos += size
    return ""


@dataclass
class Decoded:
    """What a client needs from a (Delta)DiscoveryResponse."""

    type_url: str = ""
    version: str = ""
    nonce: str = ""
    resources: list[tuple[str, Key]] = field(default_factory=list)  # (name, key)
    values: list[bytes] = field(default_factory=list)  # the Any values (LDS only)
    removed: list[str] = field(default_factory=list)


def decode_sotw(raw: bytes) -> Decoded:
    """SotW: the key of a resource is CRC-32 of its Any value (SotW carries no version)."""
    response = discovery_pb2.DiscoveryResponse.FromString(raw)
    out = Decoded(response.type_url, response.version_info, response.nonce)
    values = [any_.value for any_ in response.resources]
    out.resources = [(resource_name(v), zlib.crc32(v)) for v in values]
    if out.type_url == LISTENER:
        out.values = values
    return out


def decode_delta(raw: bytes) -> Decoded:
    """Delta: the key of a resource is its version."""
    response = discovery_pb2.DeltaDiscoveryResponse.FromString(raw)
    out = Decoded(response.type_url, response.system_version_info, response.nonce)
    out.resources = [(r.name, r.version) for r in response.resources]
    out.removed = list(response.removed_resources)
    if out.type_url == LISTENER:
        out.values = [r.resource.value for r in response.resources]
    return out


def route_names(listener_bytes: bytes) -> list[str]:
    """The RDS names a Listener's HTTP connection managers reference (parsed in full: rare)."""
    listener = listener_pb2.Listener.FromString(listener_bytes)
    names = []
    for chain in [*listener.filter_chains, listener.default_filter_chain]:
        for net_filter in chain.filters:
            if net_filter.typed_config.type_url.endswith("HttpConnectionManager"):
                hcm = hcm_pb2.HttpConnectionManager.FromString(net_filter.typed_config.value)
                if hcm.HasField("rds"):
                    names.append(hcm.rds.route_config_name)
    return names


# --- what every client must hold, per tick ---------------------------------------------------

@dataclass
class Tracker:
    """Expected ClusterLoadAssignment keys per published tick, shared by a worker's clients.
    Tick 0 is the initial snapshot (every CLA, plus LDS and RDS)."""

    changed: list[tuple[str, ...]] = field(default_factory=list)  # tick -> changed CLA names
    key_tick: dict[str, dict[Key, int]] = field(default_factory=dict)  # name -> key -> tick
    done_count: list[int] = field(default_factory=list)

    def expect(self, tick: int, keys: dict[str, tuple[str, int]]) -> None:
        if tick != len(self.changed):
            raise ValueError(f"tick {tick} announced out of order")
        self.changed.append(tuple(keys))
        self.done_count.append(0)
        for name, (version, crc) in keys.items():
            by_key = self.key_tick.setdefault(name, {})
            by_key[version] = by_key[crc] = tick

    def tick_of(self, name: str, key: Key) -> int:
        return self.key_tick.get(name, {}).get(key, -1)


@dataclass
class ClientStats:
    node_id: str
    api: str
    done: list[float] = field(default_factory=list)  # tick -> time it held every change
    held: dict[str, int] = field(default_factory=dict)  # CLA name -> tick of the held version
    keys: dict[str, Key] = field(default_factory=dict)  # CLA name -> key held
    got: set[str] = field(default_factory=set)  # type URLs received at least once
    bytes_received: int = 0
    responses: int = 0
    error: str | None = None  # why the last stream ended, if it failed
    failures: int = 0  # streams that failed (each one was retried, like Envoy does)


def _tick_complete(stats: ClientStats, tracker: Tracker, tick: int) -> bool:
    if tick == 0 and not {CLUSTER, LISTENER, ROUTE} <= stats.got:
        return False
    held = stats.held
    return all(held.get(name, -1) >= tick for name in tracker.changed[tick])


def advance(stats: ClientStats, tracker: Tracker, now: float) -> None:
    """Mark every tick this client now holds completely as done at `now`."""
    while len(stats.done) < len(tracker.changed) and _tick_complete(stats, tracker,
                                                                      len(stats.done)):
        tracker.done_count[len(stats.done)] += 1
        stats.done.append(now)


def note_endpoints(stats: ClientStats, tracker: Tracker, decoded: Decoded) -> None:
    for name, key in decoded.resources:
        stats.held[name] = tracker.tick_of(name, key)
        stats.keys[name] = key
    for name in decoded.removed:
        stats.held.pop(name, None)
        stats.keys.pop(name, None)


# --- the clients ---------------------------------------------------------------------------

def _sotw(type_url: str, names: list[str] | None = None, version: str = "", nonce: str = "",
          node: base_pb2.Node | None = None) -> bytes:
    return discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names or [],
                                          version_info=version, response_nonce=nonce,
                                          node=node).SerializeToString()


def _delta(type_url: str, subscribe: list[str] | None = None,
           unsubscribe: list[str] | None = None, nonce: str = "",
           node: base_pb2.Node | None = None) -> bytes:
    return discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, resource_names_subscribe=subscribe or [],
        resource_names_unsubscribe=unsubscribe or [], response_nonce=nonce,
        node=node).SerializeToString()


class Client:
    """One simulated Envoy on one ADS stream."""

    def __init__(self, stats: ClientStats, tracker: Tracker) -> None:
        self.stats = stats
        self.tracker = tracker
        self.clusters: list[str] = []
        self.routes: list[str] = []
        self.eds_base = b""  # SotW: the EDS subscription part of every EDS request
        self.asked_listeners = False

    async def run(self, channel: grpc.aio.Channel) -> None:
        delta = self.stats.api == "delta"
        method = ADS + ("DeltaAggregatedResources" if delta else "StreamAggregatedResources")
        call = channel.stream_stream(method)()
        node = base_pb2.Node(id=self.stats.node_id, cluster="trimtab-bench")
        try:
            await call.write(_delta(CLUSTER, node=node) if delta else _sotw(CLUSTER, node=node))
            while True:
                raw = await call.read()
                if raw is grpc.aio.EOF:
                    break
                await self._on_response(call, raw, time.monotonic(), delta)
        except grpc.aio.AioRpcError as exc:
            self.stats.error = f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()

    async def _on_response(self, call: Any, raw: bytes, now: float, delta: bool) -> None:
        self.stats.bytes_received += len(raw)
        self.stats.responses += 1
        decoded = decode_delta(raw) if delta else decode_sotw(raw)
        self.stats.got.add(decoded.type_url)
        requests: list[bytes] = []
        if decoded.type_url == CLUSTER:
            requests += self._on_clusters(decoded, delta)
        elif decoded.type_url == ENDPOINT:
            note_endpoints(self.stats, self.tracker, decoded)
        elif decoded.type_url == LISTENER:
            requests += self._on_listeners(decoded, delta)
        advance(self.stats, self.tracker, now)
        requests.append(self._ack(decoded, delta))
        for request in requests:
            await call.write(request)

    def _ack(self, decoded: Decoded, delta: bool) -> bytes:
        if delta:
            return _delta(decoded.type_url, nonce=decoded.nonce)
        if decoded.type_url == ENDPOINT:  # SotW requests repeat the whole subscription
            return self.eds_base + _sotw("", version=decoded.version, nonce=decoded.nonce)
        names = self.routes if decoded.type_url == ROUTE else []
        return _sotw(decoded.type_url, names, decoded.version, decoded.nonce)

    def _on_clusters(self, decoded: Decoded, delta: bool) -> list[bytes]:
        """Envoy asks for the clusters' EDS before it ACKs CDS, and for LDS after the first."""
        if delta:
            known = set(self.clusters)
            new = [name for name, _ in decoded.resources if name not in known]
            gone = [name for name in decoded.removed if name in known]
            self.clusters = [n for n in self.clusters if n not in set(gone)] + new
            out = [_delta(ENDPOINT, new, gone)] if new or gone else []
        else:
            names = sorted(name for name, _ in decoded.resources)
            out = []
            if names != self.clusters:
                self.clusters = names
                self.eds_base = _sotw(ENDPOINT, names)
                out.append(self.eds_base)
        if not self.asked_listeners:
            self.asked_listeners = True
            out.append(_delta(LISTENER) if delta else _sotw(LISTENER))
        return out

    def _on_listeners(self, decoded: Decoded, delta: bool) -> list[bytes]:
        names = sorted({n for value in decoded.values for n in route_names(value)})
        if names == self.routes:
            return []
        new = [n for n in names if n not in self.routes]
        self.routes = names
        return [_delta(ROUTE, new) if delta else _sotw(ROUTE, names)]


def channel_options(max_receive: int = ENVOY_MAX_RECEIVE) -> list[tuple[str, Any]]:
    """One TCP connection per client (no subchannel sharing), Envoy's message limit."""
    return [("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", max_receive)]


def backoff(attempt: int, rng: random.Random) -> float:
    """Envoy's xDS retry: jittered exponential backoff from 0.5 s, capped at 30 s."""
    return rng.uniform(0, min(30.0, 0.5 * 2**attempt))


async def run_client(target: str, stats: ClientStats, tracker: Tracker,
                     max_receive: int = ENVOY_MAX_RECEIVE, retry: bool = True) -> None:
    """One simulated Envoy; like Envoy it opens a new stream whenever one fails (`retry`)."""
    rng = random.Random(stats.node_id)
    async with grpc.aio.insecure_channel(target, options=channel_options(max_receive)) as channel:
        for attempt in itertools.count():
            stats.error = None
            await Client(stats, tracker).run(channel)
            if stats.error is None or not retry:
                return
            stats.failures += 1
            await asyncio.sleep(backoff(attempt, rng))


# --- a worker process: many clients on one event loop, driven over a pipe ------------------

@dataclass
class WorkerSpec:
    target: str
    clients: list[tuple[str, str]]  # (node id, api)
    max_receive: int = ENVOY_MAX_RECEIVE


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def worker_main(conn: Connection, spec: WorkerSpec) -> None:
    """Entry point of a worker process. Commands: ("expect", tick, keys), ("go",),
    ("mark",) (its CPU seconds), ("report",), ("stop",). It sends ("tick_done", tick, last time) once all its clients hold a
    tick, and answers each command."""
    raise_fd_limit()
    asyncio.run(_Worker(conn, spec).serve())


class _Worker:
    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        self.conn, self.spec = conn, spec
        self.tracker = Tracker()
        self.stats = [ClientStats(node_id, api) for node_id, api in spec.clients]
        self.tasks: list[asyncio.Task] = []
        self.reported: set[int] = set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        loop.add_reader(self.conn.fileno(), lambda: inbox.put_nowait(self.conn.recv()))
        self.conn.send(("ready", os.getpid()))
        watcher = asyncio.create_task(self._watch_ticks())
        try:
            while (command := await inbox.get())[0] != "stop":
                self.conn.send(self._handle(command))
        finally:
            loop.remove_reader(self.conn.fileno())
            for task in [*self.tasks, watcher]:
                task.cancel()
            await asyncio.gather(*self.tasks, watcher, return_exceptions=True)
            self.conn.send(("stopped",))

    def _handle(self, command: tuple) -> tuple:
        if command[0] == "expect":
            self.tracker.expect(command[1], command[2])
            for stats in self.stats:  # a client may already hold it (a reverted weight)
                advance(stats, self.tracker, time.monotonic())
            return ("ack",)
        if command[0] == "go":
            self.tasks = [asyncio.create_task(run_client(self.spec.target, stats, self.tracker,
                                                         self.spec.max_receive))
                          for stats in self.stats]
            return ("ack",)
        if command[0] == "report":
            return ("report", self._report())
        if command[0] == "mark":
            cpu = os.times()
            return ("mark", cpu.user + cpu.system)
        raise ValueError(f"unknown command {command!r}")

    async def _watch_ticks(self) -> None:
        """Tell the driver when every client of this worker holds a tick."""
        while True:
            for tick, count in enumerate(self.tracker.done_count):
                if tick not in self.reported and count == len(self.stats):
                    self.reported.add(tick)
                    last = max(s.done[tick] for s in self.stats)
                    self.conn.send(("tick_done", tick, last))
            await asyncio.sleep(0.02)

    def _report(self) -> dict[str, Any]:
        cpu = os.times()
        ticks = len(self.tracker.changed)
        return {
            "done": [[s.done[t] if t < len(s.done) else None for s in self.stats]
                     for t in range(ticks)],
            "bytes_received": sum(s.bytes_received for s in self.stats),
            "responses": sum(s.responses for s in self.stats),
            "errors": [f"{s.node_id}: {s.error}" for s in self.stats if s.error],
            "failures": sum(s.failures for s in self.stats),
            "failed_clients": sum(1 for s in self.stats if s.failures),
            "cpu_s": cpu.user + cpu.system,
            "keys": [dict(s.keys) for s in self.stats[:3]],  # a sample, for the final check
            "apis": [s.api for s in self.stats[:3]],
        }
