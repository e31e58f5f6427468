"""The grpc.aio servicers with a real grpcio client (in-process server, no Envoy)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import tracemalloc

import grpc
import pytest
from envoy.config.cluster.v3.cluster_pb2 import Cluster
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.config.listener.v3.listener_pb2 import Listener
from envoy.config.route.v3.route_pb2 import RouteConfiguration
from envoy.service.discovery.v3.discovery_pb2 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)

from tests.support.metrics import sample_value
from tests.support.wait import wait_until_async
from tests.support.xds_fixtures import BASE, snapshot
from xds_server.app import Trimtab
from xds_server.config.load import ConfigError, parse_config
from xds_server.xds import server as transport
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.heap import HeapTrimmer, held_names
from xds_server.xds.observers import push_log
from xds_server.xds.protocol import RESPONSE_HEADROOM, StreamLimits
from xds_server.xds.server import XdsServicer, start_xds_server
from xds_server.xds.snapshot import build_snapshot
from xds_server.xds.stream_info import INBOX_LIMIT, Inbox


async def _with_server(body, channel_options: list[tuple[str, int]] | None = None,
                       limits: StreamLimits | None = None):
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(BASE))
    servicer = XdsServicer(cache, limits=limits)
    server, port = await start_xds_server(servicer, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options) as channel:
            await body(channel, cache, servicer)
    finally:
        await server.stop(None)


def _sotw_call(channel, method: str):
    return channel.stream_stream(method, request_serializer=DiscoveryRequest.SerializeToString,
                                 response_deserializer=DiscoveryResponse.FromString)()


def test_per_type_cds_service_and_ack_flow():
    async def body(channel, cache, servicer):
        call = _sotw_call(channel, "/envoy.service.cluster.v3.ClusterDiscoveryService/StreamClusters")
        await call.write(DiscoveryRequest(node={"id": "client-1"}))
        resp = await asyncio.wait_for(call.read(), 5)
        assert resp.type_url == T.CLUSTER
        names = sorted(Cluster.FromString(a.value).name for a in resp.resources)
        assert names == ["a", "b"]
        await call.write(DiscoveryRequest(response_nonce=resp.nonce, version_info=resp.version_info))
        await asyncio.sleep(0.1)
        assert [s.node_id for s in servicer.streams] == ["client-1"]
        call.cancel()
    asyncio.run(_with_server(body))


def test_ads_pushes_new_snapshot_to_open_stream():
    async def body(channel, cache, servicer):
        call = _sotw_call(channel,
                          "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources")
        await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"]))
        first = await asyncio.wait_for(call.read(), 5)
        await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"],
                                          response_nonce=first.nonce, version_info=first.version_info))
        await asyncio.sleep(0.05)
        cache.set_snapshot(snapshot({**BASE, "b": {"10.0.1.1:80": 33}}))
        second = await asyncio.wait_for(call.read(), 5)
        assert len(second.resources) == 1 and second.nonce != first.nonce
        call.cancel()
    asyncio.run(_with_server(body))


def test_delta_ads_over_grpc():
    async def body(channel, cache, servicer):
        call = channel.stream_stream(
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources",
            request_serializer=DeltaDiscoveryRequest.SerializeToString,
            response_deserializer=DeltaDiscoveryResponse.FromString)()
        await call.write(DeltaDiscoveryRequest(type_url=T.CLUSTER))
        resp = await asyncio.wait_for(call.read(), 5)
        assert sorted(r.name for r in resp.resources) == ["a", "b"]
        assert all(r.version for r in resp.resources)
        call.cancel()
    asyncio.run(_with_server(body))


def test_protocol_error_closes_stream_with_invalid_argument():
    async def body(channel, cache, servicer):
        call = _sotw_call(channel,
                          "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources")
        await call.write(DiscoveryRequest(resource_names=["a"]))  # no type_url on ADS
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "type_url" in (info.value.details() or "")
    asyncio.run(_with_server(body))


def _pushes(kind: str, api: str) -> float:
    return sample_value("trimtab_xds_pushes_total", type=kind, api=api)


async def _two_eds_pushes(channel, cache, servicer):
    """Subscribe to EDS a+b, ACK the first push, then publish a change to b (stamped as if
    its telemetry was read 0.05 s earlier) and ACK that push too."""
    servicer.push_log.window_s = 0.05
    call = _sotw_call(channel,
                      "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources")
    await call.write(DiscoveryRequest(node={"id": "n-1"}, type_url=T.ENDPOINT,
                                      resource_names=["a", "b"]))
    first = await asyncio.wait_for(call.read(), 5)
    await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"],
                                      response_nonce=first.nonce, version_info=first.version_info))
    await asyncio.sleep(0.05)
    cache.set_snapshot(snapshot({**BASE, "b": {"10.0.1.1:80": 33}}),
                       read_at=time.monotonic() - 0.05)
    second = await asyncio.wait_for(call.read(), 5)
    await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"],
                                      response_nonce=second.nonce,
                                      version_info=second.version_info))
    await asyncio.sleep(0.2)
    assert sample_value("trimtab_xds_subscriptions", type="eds", api="sotw") >= 1
    call.cancel()


def _messages(caplog, level: int, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and r.getMessage().startswith(prefix)]


def test_with_few_streams_every_push_gets_one_info_line(caplog):
    before = _pushes("eds", "sotw")
    with caplog.at_level(logging.INFO, logger="trimtab.xds"):
        asyncio.run(_with_server(_two_eds_pushes))
    assert _pushes("eds", "sotw") == before + 2
    per_push = _messages(caplog, logging.INFO, "push eds")
    assert len(per_push) == 2 and "'n-1'" in per_push[0] and "2 resources" in per_push[0]
    assert "1 resources" in per_push[1]
    assert not _messages(caplog, logging.INFO, "pushed eds")


def test_with_many_streams_pushes_are_summarised_at_info(caplog, monkeypatch):
    monkeypatch.setattr(push_log, "PER_PUSH_LOG_STREAMS", 0)
    with caplog.at_level(logging.DEBUG, logger="trimtab.xds"):
        asyncio.run(_with_server(_two_eds_pushes))
    assert len(_messages(caplog, logging.DEBUG, "push eds")) == 2
    assert not _messages(caplog, logging.INFO, "push eds")
    summaries = _messages(caplog, logging.INFO, "pushed eds (sotw)")
    assert summaries and sum(int(m.split()[3]) for m in summaries) == 2
    assert all("resources" in m and "bytes" in m and "versions" in m for m in summaries)


def _convergence_count() -> float:
    return sample_value("trimtab_convergence_seconds_count", api="sotw")
    return 0.0


def test_an_ack_of_a_stamped_assignment_is_observed_as_convergence():
    before = _convergence_count()
    asyncio.run(_with_server(_two_eds_pushes))
    assert _convergence_count() == before + 1  # only b changed, and it was stamped
    assert sample_value("trimtab_xds_subscriptions", type="eds", api="sotw") == 0


# ---- the per-type services ----------------------------------------------------------------

_MESSAGES = {T.CLUSTER: Cluster, T.ENDPOINT: ClusterLoadAssignment, T.LISTENER: Listener,
             T.ROUTE: RouteConfiguration}
_SUBSCRIBE = {T.CLUSTER: [], T.ENDPOINT: ["a"], T.LISTENER: [], T.ROUTE: ["routes"]}
_EXPECTED = {T.CLUSTER: ["a", "b"], T.ENDPOINT: ["a"], T.LISTENER: ["listener"],
             T.ROUTE: ["routes"]}
_PER_TYPE = [(service, methods[api], methods[2], api)
             for service, methods in transport._SERVICES.items() if methods[2] is not None
             for api in (0, 1)]


def _resource_name(type_url: str, payload: bytes) -> str:
    message = _MESSAGES[type_url].FromString(payload)
    return message.cluster_name if type_url == T.ENDPOINT else message.name


async def _per_type_exchange(channel, path: str, type_url: str, delta: bool) -> str:
    """Subscribe on a per-type method (type_url left empty, as Envoy may), check the first
    response, ACK it; returns the response's version."""
    names = _SUBSCRIBE[type_url]
    if delta:
        call = channel.stream_stream(path, request_serializer=DeltaDiscoveryRequest.SerializeToString,
                                     response_deserializer=DeltaDiscoveryResponse.FromString)()
        await call.write(DeltaDiscoveryRequest(node={"id": "per-type"},
                                               resource_names_subscribe=names))
        resp = await asyncio.wait_for(call.read(), 5)
        got = sorted(_resource_name(type_url, r.resource.value) for r in resp.resources)
        await call.write(DeltaDiscoveryRequest(response_nonce=resp.nonce))
        version = resp.system_version_info
    else:
        call = _sotw_call(channel, path)
        await call.write(DiscoveryRequest(node={"id": "per-type"}, resource_names=names))
        resp = await asyncio.wait_for(call.read(), 5)
        got = sorted(_resource_name(type_url, a.value) for a in resp.resources)
        await call.write(DiscoveryRequest(resource_names=names, response_nonce=resp.nonce,
                                          version_info=resp.version_info))
        version = resp.version_info
    assert resp.type_url == type_url
    assert got == _EXPECTED[type_url]
    return version


@pytest.mark.parametrize(("service", "method", "type_url", "api"), _PER_TYPE,
                         ids=[f"{T.short_name(t)}-{'delta' if a else 'sotw'}"
                              for _, _, t, a in _PER_TYPE])
def test_every_per_type_service_serves_its_type_and_takes_the_ack(service, method, type_url, api):
    async def body(channel, cache, servicer):
        version = await _per_type_exchange(channel, f"/{service}/{method}", type_url, api == 1)
        assert version  # SotW: the subscribed resources' version; Delta: the type's

        def acked() -> str:
            [info] = servicer.streams
            return info.machine.types[type_url].acked_version

        assert await wait_until_async(acked, 2.0, "the ACK", every=0.02) == version
    asyncio.run(_with_server(body))


# ---- inbound backpressure -----------------------------------------------------------------

BIG = 16 * 2**20  # far more than a stream that does not read absorbs (~4 MiB, grpcio 1.85)


def _big_cds():
    """One cluster of BIG bytes: the server's write of it blocks until the client reads."""
    return build_snapshot({T.CLUSTER: [Cluster(name="big", type=Cluster.STATIC,
                                               alt_stat_name="x" * BIG)]})


async def _write_all(call, requests: list[DiscoveryRequest], written: list[int]) -> None:
    for request in requests:
        await call.write(request)
        written[0] += 1


async def _stalled(written: list[int], quiet_s: float = 0.3, timeout: float = 5.0) -> None:
    """Until `written[0]` has not grown for `quiet_s`."""
    deadline = time.monotonic() + timeout
    while True:
        before = written[0]
        await asyncio.sleep(quiet_s)
        if written[0] == before:
            return
        assert time.monotonic() < deadline, "the client's writes never stalled"


def test_inbox_put_waits_while_full_and_the_end_mark_never_waits():
    async def body():
        inbox = Inbox(limit=2)
        await inbox.put("r1")
        await inbox.put("r2")
        third = asyncio.create_task(inbox.put("r3"))
        await asyncio.sleep(0.01)
        assert not third.done() and len(inbox) == 2
        assert inbox.popleft() == "r1"
        await asyncio.wait_for(third, 1)
        inbox.end()  # full, yet the end of the stream is recorded at once
        assert [inbox.popleft() for _ in range(len(inbox))] == ["r2", "r3", None]
        assert inbox.max_seen == 2
    asyncio.run(body())


def test_a_client_that_writes_without_reading_is_held_to_the_inbox_bound():
    """While the pump is blocked writing to a client that does not read, the stream reads at
    most INBOX_LIMIT requests ahead; gRPC flow control then stalls the client's writes."""
    flood = [DiscoveryRequest(node={"id": "flood"}, type_url=T.CLUSTER)] + [
        DiscoveryRequest(type_url=T.CLUSTER, response_nonce="stale",
                         resource_names=["pad-" + "x" * 2000])] * 5000  # ~10 MB of requests

    async def body(channel, cache, servicer):
        cache.set_snapshot(_big_cds())
        call = _sotw_call(channel, "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
                                   "StreamAggregatedResources")
        written = [0]
        writer = asyncio.create_task(_write_all(call, flood, written))
        await wait_until_async(lambda: any(len(s.inbox) >= INBOX_LIMIT for s in servicer.streams))
        [info] = servicer.streams
        await _stalled(written)
        assert len(info.inbox) == info.inbox.max_seen == INBOX_LIMIT
        assert not writer.done() and written[0] < len(flood)  # gRPC pushed back on the client
        big = await asyncio.wait_for(call.read(), 5)
        await asyncio.wait_for(writer, 10)
        assert [len(Cluster.FromString(a.value).alt_stat_name) for a in big.resources] == [BIG]
        await call.write(DiscoveryRequest(type_url=T.CLUSTER, response_nonce=big.nonce,
                                          version_info=big.version_info))
        cache.set_snapshot(snapshot(BASE))  # the stream still works: it gets the next push
        small = await asyncio.wait_for(call.read(), 5)
        assert sorted(Cluster.FromString(a.value).name for a in small.resources) == ["a", "b"]
        assert info.machine.types[T.CLUSTER].acked_version == big.version_info
        assert info.inbox.max_seen == INBOX_LIMIT
        call.cancel()
    asyncio.run(_with_server(body, [("grpc.max_receive_message_length", 2 * BIG)],
                             StreamLimits(max_response_bytes=2 * BIG)))  # one 16 MiB response


# ---- limits: names per subscription, memory of closed streams -------------------------------

ADS_SOTW = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
ADS_DELTA = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"


def _made_up(count: int, tag: str = "") -> list[str]:
    return [f"made-up-{tag}{i:07d}" for i in range(count)]


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_request_naming_more_than_max_resource_names_ends_the_stream_resource_exhausted(api):
    async def body(channel, cache, servicer):
        if api == "sotw":
            call = _sotw_call(channel, ADS_SOTW)
            await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=_made_up(101)))
        else:
            call = channel.stream_stream(
                ADS_DELTA, request_serializer=DeltaDiscoveryRequest.SerializeToString,
                response_deserializer=DeltaDiscoveryResponse.FromString)()
            await call.write(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                                   resource_names_subscribe=_made_up(60)))
            await call.write(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                                   resource_names_subscribe=_made_up(41, "x")))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                await asyncio.wait_for(call.read(), 5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "101 eds resource names" in (info.value.details() or "")
        assert "xds.limits.max_resource_names" in (info.value.details() or "")
        await wait_until_async(lambda: not servicer.streams)
    asyncio.run(_with_server(body, limits=StreamLimits(max_resource_names=100)))


def test_a_closed_stream_leaves_nothing_of_its_subscription_behind():
    """A stream that subscribed EDS to 100,000 made-up names holds them while it is open; once
    it closes, nothing of them stays (the subset memo keys only names the snapshot has)."""
    names = _made_up(100_000)

    async def body(channel, cache, servicer):
        request = DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", *names])
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            call = _sotw_call(channel, ADS_SOTW)
            await call.write(request)
            first = await asyncio.wait_for(call.read(), 5)
            assert [ClusterLoadAssignment.FromString(a.value).cluster_name
                    for a in first.resources] == ["a"]
            [info] = servicer.streams
            assert len(info.machine.types[T.ENDPOINT].names) == 100_001
            del info
            held = tracemalloc.get_traced_memory()[0] - before
            call.cancel()
            await wait_until_async(lambda: not servicer.streams)
            gc.collect()
            left = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        memo = cache.snapshot.subset_memo
        assert len(memo) == 1 and memo.bytes < 2_000  # {a} only
        assert held > 8_000_000 and left < 1_000_000, (held, left)
    asyncio.run(_with_server(body, limits=StreamLimits(max_resource_names=200_000)))


def test_the_heap_is_trimmed_once_after_streams_holding_many_names_close():
    calls: list[int] = []

    async def body():
        trimmer = HeapTrimmer(min_names=1000, delay_s=0.05, trim=lambda pad: calls.append(pad) or 1)
        trimmer.closed(400)
        trimmer.closed(500)  # 900 names so far: not worth a trim
        await asyncio.sleep(0.1)
        assert calls == [] and trimmer.trims == 0
        for _ in range(5):  # closes in a burst share one trim
            trimmer.closed(300)
        await wait_until_async(lambda: trimmer.trims == 1)
        await asyncio.sleep(0.1)
        assert calls == [0] and trimmer.trims == 1
        machine = transport.SotwStream()
        machine.receive(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b", "c"]))
        machine.responses(snapshot(BASE))
        assert held_names(machine) == 3 + 2  # subscribed, and sent
    asyncio.run(body())


def test_a_whole_state_too_large_to_send_is_withheld_and_logged_once_as_ours(caplog):
    """CDS must be sent whole: above max_response_bytes it is not sent (never over the
    limit), and one error line says so however many streams ask; the streams stay up."""
    async def body(channel, cache, servicer):
        calls = []
        for _ in range(2):
            call = _sotw_call(channel, ADS_SOTW)
            await call.write(DiscoveryRequest(type_url=T.CLUSTER))
            await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a"]))
            eds = await asyncio.wait_for(call.read(), 5)
            assert eds.type_url == T.ENDPOINT  # EDS fits and is sent; CDS is not
            calls.append(call)
        await wait_until_async(lambda: len(servicer.streams) == 2)
        assert all(s.machine.types[T.CLUSTER].last_nonce == "" for s in servicer.streams)
        errors = _messages(caplog, logging.ERROR, "not sending cds")
        assert len(errors) == 1 and "whole-state type cannot be split" in errors[0]
        for call in calls:
            call.cancel()
    caplog.set_level(logging.ERROR, logger="trimtab.xds")
    cds = sum(len(r.sotw_field) for r in snapshot(BASE).of_type(T.CLUSTER).values())
    asyncio.run(_with_server(body, limits=StreamLimits(
        max_response_bytes=RESPONSE_HEADROOM + cds - 1)))


def test_the_xds_limits_in_the_config_reach_every_stream():
    base = {"pools": [{"name": "p", "model": "m", "endpoints": [{"address": "10.0.0.1:80"}]}]}
    default = parse_config(base).xds.limits
    assert (default.max_resource_names, default.max_response_bytes) == (
        StreamLimits().max_resource_names, StreamLimits().max_response_bytes) == (16_384, 4 * 2**20)
    config = parse_config({**base, "xds": {"limits": {"max_resource_names": 500,
                                                      "max_response_bytes": 1_000_000}}})
    servicer = Trimtab(config).servicer
    assert servicer.limits == StreamLimits(500, 1_000_000)
    with pytest.raises(ConfigError, match="max_response_bytes"):
        parse_config({**base, "xds": {"limits": {"max_response_bytes": 1000}}})


def test_an_oversized_node_id_ends_the_stream_invalid_argument_and_is_logged_cut(caplog):
    """The review's attack: an 8.4 MB node id. Refused on its first request, naming the field
    and the bound; the log line shows a bounded, escaped head of it."""
    async def body(channel, cache, servicer):
        call = _sotw_call(channel, ADS_SOTW)
        await call.write(DiscoveryRequest(node={"id": "\n" + "x" * 8_400_000},
                                          type_url=T.CLUSTER))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(
            "node.id is 8400001 bytes; this server accepts at most 1024")
        await wait_until_async(lambda: not servicer.streams)
    with caplog.at_level(logging.INFO, logger="trimtab.xds"):
        asyncio.run(_with_server(body))
    lines = [r.getMessage() for r in caplog.records if "node.id is" in r.getMessage()]
    assert len(lines) == 1 and len(lines[0]) < 500 and "\n" not in lines[0]


def test_a_delta_stream_over_its_subscription_byte_budget_ends_resource_exhausted():
    async def body(channel, cache, servicer):
        call = channel.stream_stream(
            ADS_DELTA, request_serializer=DeltaDiscoveryRequest.SerializeToString,
            response_deserializer=DeltaDiscoveryResponse.FromString)()
        for i in range(5):  # a new 1,000-byte name per request; the fifth is over the budget
            await call.write(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                                   resource_names_subscribe=[f"{i}" * 1000]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                await asyncio.wait_for(call.read(), 5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "would hold 5000 bytes" in (info.value.details() or "")
        assert "max_subscription_bytes" in (info.value.details() or "")
        await wait_until_async(lambda: not servicer.streams)
    asyncio.run(_with_server(body, limits=StreamLimits(max_subscription_bytes=4500)))
