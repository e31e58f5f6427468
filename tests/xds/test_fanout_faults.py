"""Fan-out faults over real gRPC (in-process trimtab server, grpcio clients, no Envoy).

* A stuck stream (never reads) delays nobody: the event loop stays responsive, a normal
  client still gets every update, and the stuck stream's backlog is one response per type.
* A storm of clients connecting at once is all served.
* Message size: 50k endpoints fit one response; a push over 4 MiB reaches a client with a 4 MiB
  receive limit in parts (docs/scale.md).
* A NACKed resource version is never re-sent on its stream while other resources keep updating;
  a new stream of the same node id gets the current state.
* An impostor claiming a node id and NACKing everything does not deny that node its config.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3.discovery_pb2 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)
from google.rpc import status_pb2

from benchmarks.fanout_client import (
    ENVOY_MAX_RECEIVE,
    Client,
    ClientStats,
    Tracker,
    channel_options,
    run_client,
)
from benchmarks.xds_fanout import (
    cla_keys,
    initial_response_sizes,
    make_controller,
    snapshot_of,
    synthetic_config,
)
from tests.support import xds_fixtures as fixtures
from tests.support.wait import wait_until_async
from tests.support.xds_fixtures import snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.protocol import Response, StreamLimits
from xds_server.xds.server import XdsServicer, encode_delta, encode_sotw, start_xds_server
from xds_server.xds.snapshot import Snapshot, build_snapshot
from xds_server.xds.stream_info import StreamInfo

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
WAIT_S = 5.0  # generous: every bound here is "promptly", not a performance figure


class RecordingServicer(XdsServicer):
    """Counts responses handed to gRPC and the ones whose write completed, per node."""

    def __init__(self, cache: SnapshotCache, limits: StreamLimits | None = None) -> None:
        super().__init__(cache, limits=limits)
        self.started: Counter[tuple[str, str]] = Counter()
        self.finished: Counter[tuple[str, str]] = Counter()

    async def _send(self, info: StreamInfo, response: Response,
                    context: grpc.aio.ServicerContext) -> None:
        key = (info.node_id, T.short_name(response.type_url))
        self.started[key] += 1
        await super()._send(info, response, context)
        self.finished[key] += 1


@contextlib.asynccontextmanager
async def serving(cache: SnapshotCache, limits: StreamLimits | None = None
                  ) -> AsyncIterator[tuple[RecordingServicer, str]]:
    servicer = RecordingServicer(cache, limits)
    server, port = await start_xds_server(servicer, "127.0.0.1:0")
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def current(cache: SnapshotCache) -> Snapshot:
    assert cache.snapshot is not None
    return cache.snapshot


class LoopLag:
    """The worst delay of a 5 ms timer on this loop: a blocked loop shows up as a large lag."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(0.005)
            self.worst = max(self.worst, loop.time() - started - 0.005)

    def __enter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


STUCK_WINDOW = 4 * 2**20  # measured: a stream that never reads still absorbs ~4 MiB (grpcio 1.85)


@functools.cache
def _big_cla() -> ClusterLoadAssignment:
    """~6 MB: more than an unread stream absorbs, so a write to it really blocks."""
    return fixtures.cla("big", {f"10.{e >> 16}.{(e >> 8) & 255}.{e & 255}:8000": 50
                                for e in range(200_000)})


def stuck_snapshot(step: int, huge: bool = True) -> Snapshot:
    """Two ~150 KB CLAs whose weights change at every step (and a static huge one)."""
    small = {f"small-{c}": {f"10.20{c}.{e >> 8}.{e & 255}:8000": (e + step) % 100 + 1
                            for e in range(5000)}
             for c in range(2)}
    names = ["big", *small] if huge else list(small)
    return build_snapshot({
        T.CLUSTER: [fixtures.cluster(n) for n in names],
        T.ENDPOINT: ([_big_cla()] if huge else []) + [fixtures.cla(n, w)
                                                        for n, w in small.items()],
        T.LISTENER: [fixtures.listener()],
        T.ROUTE: [fixtures.routes(names)],
    })


# ---- a stuck stream ---------------------------------------------------------------------------

async def _stuck_stream(channel: grpc.aio.Channel, names: list[str]) -> grpc.aio.StreamStreamCall:
    """Asks for CDS, EDS, LDS and RDS like Envoy, then never reads a response."""
    call = channel.stream_stream(ADS + "StreamAggregatedResources")()
    await call.write(DiscoveryRequest(node={"id": "stuck"}, type_url=T.CLUSTER).SerializeToString())
    for type_url, wanted in ((T.ENDPOINT, names), (T.LISTENER, []), (T.ROUTE, ["routes"])):
        await call.write(DiscoveryRequest(type_url=type_url,
                                          resource_names=wanted).SerializeToString())
    return call


def _stuck_machine(servicer: XdsServicer):
    [info] = [s for s in servicer.streams if s.node_id == "stuck"]
    return info.machine


async def _publish_and_follow(cache: SnapshotCache, stats: ClientStats, tracker: Tracker,
                              updates: int, huge: bool) -> None:
    """Publish `updates` snapshots; each must reach the normal client before the next."""
    for step in range(1, updates + 1):
        new = stuck_snapshot(step, huge)
        tracker.expect(step, cla_keys(new, current(cache)))
        cache.set_snapshot(new)
        await wait_until_async(lambda s=step: len(stats.done) > s)


@pytest.mark.parametrize(("shared_connection", "huge"), [(False, True), (True, True), (False, False)],
                         ids=["blocked-write", "blocked-write-shared-connection", "unacked"])
def test_stuck_stream_delays_nobody_and_coalesces(shared_connection, huge):
    """blocked-write: the stuck stream's first EDS response exceeds what an unread stream
    absorbs, so the server's write to it never completes. unacked: every write completes but the
    stuck stream never ACKs; only the one-response-per-type rule bounds its backlog."""
    updates = 20

    async def body() -> None:
        cache = SnapshotCache()
        cache.set_snapshot(stuck_snapshot(0, huge))
        eds_bytes = sum(len(r.payload) for r in current(cache).of_type(T.ENDPOINT).values())
        assert (eds_bytes > STUCK_WINDOW) == huge
        options = channel_options(64 * 2**20)  # the point here is flow control, not 4 MiB
        async with serving(cache, StreamLimits(max_response_bytes=64 * 2**20)) as (
                servicer, target), \
                grpc.aio.insecure_channel(target, options=options) as stuck_channel:
            stuck = await _stuck_stream(stuck_channel, sorted(current(cache).of_type(T.ENDPOINT)))
            await wait_until_async(lambda: servicer.started["stuck", "eds"] == 1)
            tracker, stats = Tracker(), ClientStats("normal", "sotw")
            tracker.expect(0, cla_keys(current(cache), None))
            channel = (stuck_channel if shared_connection
                       else grpc.aio.insecure_channel(target, options=options))
            normal = asyncio.create_task(Client(stats, tracker).run(channel))
            with LoopLag() as lag:
                await wait_until_async(lambda: len(stats.done) == 1)
                await _publish_and_follow(cache, stats, tracker, updates, huge)
            assert stats.error is None and len(stats.done) == updates + 1
            assert lag.worst < 1.0, f"the event loop stalled for {lag.worst:.3f} s"
            _assert_stuck_backlog(servicer, blocked=huge)
            normal.cancel()
            stuck.cancel()
            if not shared_connection:
                await channel.close()

    asyncio.run(body())


def _assert_stuck_backlog(servicer: RecordingServicer, blocked: bool) -> None:
    # blocked: its EDS write is still parked in HTTP/2 flow control (the windows are full).
    assert servicer.started["stuck", "eds"] == 1
    assert servicer.finished["stuck", "eds"] == (0 if blocked else 1)
    machine = _stuck_machine(servicer)
    nonces = {t: st.last_nonce for t, st in machine.types.items() if st.last_nonce}
    # One response per type at most, however many snapshots were published (coalescing):
    # nonces count up per response, so a second response of any type would exceed the count.
    assert nonces and max(int(n) for n in nonces.values()) == len(nonces)
    assert machine.types[T.ENDPOINT].pending_nonce == nonces[T.ENDPOINT]
    assert all(servicer.started["stuck", kind] <= 1 for kind in ("cds", "eds", "lds", "rds"))


# ---- reconnect storm ------------------------------------------------------------------------

def _pool_snapshot(pools: int, endpoints: int) -> Snapshot:
    return snapshot_of(make_controller(synthetic_config(pools, endpoints), SnapshotCache()))


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_reconnect_storm_of_200_clients_is_served(api):
    clients, bound_s = 200, 10.0

    async def body() -> None:
        cache = SnapshotCache()
        cache.set_snapshot(_pool_snapshot(10, 100))
        tracker = Tracker()
        tracker.expect(0, cla_keys(current(cache), None))
        everyone = [ClientStats(f"storm-{i:03d}", api) for i in range(clients)]
        async with serving(cache) as (servicer, target):
            started = time.monotonic()
            tasks = [asyncio.create_task(run_client(target, stats, tracker)) for stats in everyone]
            await wait_until_async(lambda: tracker.done_count[0] == clients, timeout=bound_s)
            elapsed = time.monotonic() - started
            assert len(servicer.streams) == clients
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert all(s.error is None and s.failures == 0 for s in everyone)
        want = {name: key for name, (version, crc) in cla_keys(current(cache), None).items()
                for key in ([version] if api == "delta" else [crc])}
        assert all(s.keys == want for s in everyone)
        assert elapsed < bound_s

    asyncio.run(body())


# ---- message size -----------------------------------------------------------------------------

def test_fifty_thousand_endpoints_fit_in_one_response_under_4_mib():
    """The first EDS response to a client carries every CLA at once (SotW and Delta alike), so
    its size depends on the total endpoint count, not on how the endpoints are split into pools.
    50,000 endpoints: ~1.5 MiB, under Envoy's 4 MiB default; ~3x that crosses it."""
    by_layout = {}
    for pools, per_pool in ((500, 100), (1, 50_000)):
        sizes = initial_response_sizes(_pool_snapshot(pools, per_pool))
        by_layout[pools] = sizes
        largest = max(sizes["sotw_eds"], sizes["delta_eds"])
        assert 1.0 * 2**20 < largest < 2.0 * 2**20 < ENVOY_MAX_RECEIVE
        assert largest * 2 < ENVOY_MAX_RECEIVE < largest * 3  # 4 MiB at ~100k-150k endpoints
        assert sizes["sotw_cds"] < ENVOY_MAX_RECEIVE
    # The split barely matters: within 5 % of each other.
    split, single = by_layout[500]["sotw_eds"], by_layout[1]["sotw_eds"]
    assert abs(split - single) < 0.05 * single


def _big_weights(pools: int, per_pool: int = 1000) -> dict[str, dict[str, int]]:
    return {f"pool-{p:03d}": {f"10.{p}.{e >> 8}.{e & 255}:8000": 50 for e in range(per_pool)}
            for p in range(pools)}


class SizeRecordingServicer(RecordingServicer):
    """Also records the size of every response written, per API and type."""

    def __init__(self, cache: SnapshotCache) -> None:
        super().__init__(cache)
        self.sizes: list[tuple[str, str, int]] = []

    async def _send(self, info: StreamInfo, response: Response,
                    context: grpc.aio.ServicerContext) -> None:
        data = encode_sotw(response) if info.api == "sotw" else encode_delta(response)
        self.sizes.append((info.api, T.short_name(response.type_url), len(data)))
        await super()._send(info, response, context)


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_full_push_over_4_mib_reaches_an_envoy_default_client(api):
    """160,000 endpoints in 160 CLAs of ~30 KB: ~4.7 MiB of EDS, split into parts that each
    fit Envoy's 4 MiB default; the client (4 MiB receive limit) gets and ACKs every CLA."""
    weights = _big_weights(160)

    async def body() -> None:
        cache = SnapshotCache()
        cache.set_snapshot(snapshot(weights))
        tracker, stats = Tracker(), ClientStats("big", api)
        tracker.expect(0, cla_keys(current(cache), None))
        servicer = SizeRecordingServicer(cache)
        server, port = await start_xds_server(servicer, "127.0.0.1:0")
        try:
            task = asyncio.create_task(run_client(f"127.0.0.1:{port}", stats, tracker,
                                                  ENVOY_MAX_RECEIVE, retry=False))
            with contextlib.suppress(AssertionError):
                await wait_until_async(lambda: stats.done or stats.error is not None, timeout=20)
            assert stats.error is None and stats.done, stats.error
            [info] = servicer.streams
            await wait_until_async(lambda: info.machine.types[T.ENDPOINT].pending_nonce is None)
            eds = info.machine.types[T.ENDPOINT]
            full = current(cache).versions[T.ENDPOINT]
            assert eds.acked_version == full and not eds.more  # the last part was ACKed
            assert eds.sent == {n: r.version for n, r in current(cache).of_type(T.ENDPOINT).items()}
            task.cancel()
        finally:
            await server.stop(None)
        eds_sizes = [size for _, kind, size in servicer.sizes if kind == "eds"]
        assert len(eds_sizes) == 2 and sum(eds_sizes) > ENVOY_MAX_RECEIVE
        assert max(size for _, _, size in servicer.sizes) + 5 <= ENVOY_MAX_RECEIVE

    asyncio.run(body())


# ---- a NACKed version is never re-sent ---------------------------------------------------------

def _weights(a: int, b: int) -> dict[str, dict[str, int]]:
    return {"a": {"10.0.0.1:80": a, "10.0.0.2:80": 50}, "b": {"10.0.1.1:80": b}}


class Scripted:
    """A scripted ADS client for EDS only, SotW or Delta, that can NACK."""

    def __init__(self, channel: grpc.aio.Channel, api: str, node: str) -> None:
        self.api = api
        method = "DeltaAggregatedResources" if api == "delta" else "StreamAggregatedResources"
        self.call = channel.stream_stream(ADS + method)()
        self.node = node
        self.version = ""
        self.pending_version = ""
        self.names: list[str] = []
        self.seen: list[tuple[str, bytes]] = []  # every (name, CLA bytes) ever received

    async def subscribe(self, names: list[str]) -> None:
        if self.api == "delta":
            request = DeltaDiscoveryRequest(node={"id": self.node}, type_url=T.ENDPOINT,
                                            resource_names_subscribe=names)
        else:
            request = DiscoveryRequest(node={"id": self.node}, type_url=T.ENDPOINT,
                                       resource_names=names)
        self.names = names
        await self.call.write(request.SerializeToString())

    async def read(self) -> tuple[str, dict[str, bytes]]:
        raw = await asyncio.wait_for(self.call.read(), WAIT_S)
        if self.api == "delta":
            delta = DeltaDiscoveryResponse.FromString(raw)
            got = {r.name: r.resource.value for r in delta.resources}
            nonce = delta.nonce
        else:
            sotw = DiscoveryResponse.FromString(raw)
            got = {_cla_name(a.value): a.value for a in sotw.resources}
            nonce, self.pending_version = sotw.nonce, sotw.version_info
        self.seen += got.items()
        return nonce, got

    async def answer(self, nonce: str, error: str | None = None) -> None:
        status = status_pb2.Status(code=3, message=error) if error else None
        if self.api == "delta":
            request = DeltaDiscoveryRequest(type_url=T.ENDPOINT, response_nonce=nonce,
                                            error_detail=status)
        else:
            if error is None:
                self.version = self.pending_version
            request = DiscoveryRequest(type_url=T.ENDPOINT, resource_names=self.names,
                                       version_info=self.version, response_nonce=nonce,
                                       error_detail=status)
        await self.call.write(request.SerializeToString())


def _cla_name(value: bytes) -> str:
    return ClusterLoadAssignment.FromString(value).cluster_name


def _payload(snap: Snapshot, name: str) -> bytes:
    return snap.of_type(T.ENDPOINT)[name].payload


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_nacked_version_is_never_resent_while_others_update(api):
    async def body() -> None:
        cache = SnapshotCache()
        cache.set_snapshot(snapshot(_weights(50, 10)))
        async with serving(cache) as (_, target), grpc.aio.insecure_channel(target) as channel:
            client = Scripted(channel, api, "nacker")
            await client.subscribe(["a", "b"])
            nonce, got = await client.read()
            assert sorted(got) == ["a", "b"]
            await client.answer(nonce)
            bad = snapshot(_weights(0, 10))  # weight 0: Envoy NACKs it
            cache.set_snapshot(bad)
            nonce, got = await client.read()
            assert got == {"a": _payload(bad, "a")}
            await client.answer(nonce, error="LoadBalancingWeight: value must be >= 1")
            for b_weight in range(11, 16):  # other resources keep updating
                cache.set_snapshot(snapshot(_weights(0, b_weight)))
                nonce, got = await client.read()
                assert got == {"b": _payload(current(cache), "b")}
                await client.answer(nonce)
            await _new_stream_gets_current_state(channel, api, cache, _payload(bad, "a"))
            cache.set_snapshot(snapshot(_weights(60, 15)))  # a *different* version of a is sent
            nonce, got = await client.read()
            assert got == {"a": _payload(current(cache), "a")}
            bad_crc = zlib.crc32(_payload(bad, "a"))
            assert [name for name, v in client.seen if zlib.crc32(v) == bad_crc] == ["a"]

    asyncio.run(body())


async def _new_stream_gets_current_state(channel: grpc.aio.Channel, api: str,
                                         cache: SnapshotCache, rejected: bytes) -> None:
    """The same node id on a new stream (a reconnect, or anyone claiming it) gets the current
    state, the version the first stream rejected included: NACK memory is per stream. It may
    NACK that version once; it is then not re-sent on that stream either."""
    again = Scripted(channel, api, "nacker")
    await again.subscribe(["a", "b"])
    nonce, got = await again.read()
    assert got == {"a": rejected, "b": _payload(current(cache), "b")}
    await again.answer(nonce, error="LoadBalancingWeight: value must be >= 1")
    await again.subscribe(["a", "b"])  # a re-subscription, no nonce: nothing rejected is re-sent
    with pytest.raises(asyncio.TimeoutError):  # (that NACK rejected the response: a and b)
        await asyncio.wait_for(again.read(), 0.5)
    again.call.cancel()


# ---- one client's NACKs never suppress another's config ---------------------------------------

class Impostor:
    """An ADS client that claims `node` and NACKs every response it gets, on CDS, EDS, LDS
    and RDS, asking for each type as Envoy does; it keeps its stream open."""

    def __init__(self, channel: grpc.aio.Channel, api: str, node: str) -> None:
        self.api = api
        method = "DeltaAggregatedResources" if api == "delta" else "StreamAggregatedResources"
        self.call = channel.stream_stream(ADS + method)()
        self.node = node
        self.nacked: Counter[str] = Counter()

    def _request(self, type_url: str, names: list[str], nonce: str = "",
                 error: str | None = None) -> bytes:
        status = status_pb2.Status(code=3, message=error) if error else None
        node = {"id": self.node} if not nonce and type_url == T.CLUSTER else None
        if self.api == "delta":
            return DeltaDiscoveryRequest(node=node, type_url=type_url, response_nonce=nonce,
                                         resource_names_subscribe=[] if nonce else names,
                                         error_detail=status).SerializeToString()
        return DiscoveryRequest(node=node, type_url=type_url, resource_names=names,
                                response_nonce=nonce, error_detail=status).SerializeToString()

    async def run(self, snap: Snapshot) -> None:
        wanted = {T.CLUSTER: [], T.ENDPOINT: sorted(snap.of_type(T.ENDPOINT)), T.LISTENER: [],
                  T.ROUTE: sorted(snap.of_type(T.ROUTE))}
        for type_url, names in wanted.items():
            await self.call.write(self._request(type_url, names))
        while True:
            raw = await self.call.read()
            if raw is grpc.aio.EOF:
                return
            if self.api == "delta":
                resp: DiscoveryResponse | DeltaDiscoveryResponse = DeltaDiscoveryResponse.FromString(raw)
            else:
                resp = DiscoveryResponse.FromString(raw)
            self.nacked[T.short_name(resp.type_url)] += 1
            await self.call.write(self._request(resp.type_url, wanted[resp.type_url],
                                                resp.nonce, "rejected by an impostor"))


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_an_impostor_nacking_everything_as_victim_does_not_deny_victim_its_config(api):
    async def body() -> None:
        cache = SnapshotCache()
        cache.set_snapshot(_pool_snapshot(3, 2))
        async with serving(cache) as (servicer, target), \
                grpc.aio.insecure_channel(target) as channel:
            impostor = Impostor(channel, api, "victim")
            attack = asyncio.create_task(impostor.run(current(cache)))
            await wait_until_async(lambda: set(impostor.nacked) == {"cds", "eds", "lds", "rds"})
            tracker, stats = Tracker(), ClientStats("victim", api)
            tracker.expect(0, cla_keys(current(cache), None))
            victim = asyncio.create_task(run_client(target, stats, tracker, retry=False))
            await wait_until_async(lambda: len(stats.done) == 1 or stats.error is not None)
            assert stats.error is None and stats.got == {T.CLUSTER, T.ENDPOINT, T.LISTENER,
                                                         T.ROUTE}
            assert sorted(s.node_id for s in servicer.streams) == ["victim", "victim"]
            assert dict(impostor.nacked) == {"cds": 1, "eds": 1, "lds": 1, "rds": 1}  # once each
            victim.cancel()
            attack.cancel()

    asyncio.run(body())
