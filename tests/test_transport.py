"""The grpc.aio servicers with a real grpcio client (in-process server, no Envoy)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from envoy.config.cluster.v3.cluster_pb2 import Cluster
from envoy.service.discovery.v3.discovery_pb2 import (
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    DiscoveryRequest,
    DiscoveryResponse,
)

from tests.xds_fixtures import BASE, snapshot
from xds_server import metrics, transport
from xds_server import type_urls as T
from xds_server.cache import SnapshotCache
from xds_server.transport import XdsServicer, start_xds_server


async def _with_server(body):
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(BASE))
    servicer = XdsServicer(cache)
    server, port = await start_xds_server(servicer, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
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
    return metrics.PUSHES.labels(type=kind, api=api)._value.get()


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
    previous = cache.snapshot
    cache.set_snapshot(snapshot({**BASE, "b": {"10.0.1.1:80": 33}}))
    cache.convergence.published(previous, cache.snapshot, time.monotonic() - 0.05)
    second = await asyncio.wait_for(call.read(), 5)
    await call.write(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"],
                                      response_nonce=second.nonce,
                                      version_info=second.version_info))
    await asyncio.sleep(0.2)
    assert metrics.SUBSCRIPTIONS.labels(type="eds", api="sotw")._value.get() >= 1
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
    monkeypatch.setattr(transport, "PER_PUSH_LOG_STREAMS", 0)
    with caplog.at_level(logging.DEBUG, logger="trimtab.xds"):
        asyncio.run(_with_server(_two_eds_pushes))
    assert len(_messages(caplog, logging.DEBUG, "push eds")) == 2
    assert not _messages(caplog, logging.INFO, "push eds")
    summaries = _messages(caplog, logging.INFO, "pushed eds (sotw)")
    assert summaries and sum(int(m.split()[3]) for m in summaries) == 2
    assert all("resources" in m and "bytes" in m and "versions" in m for m in summaries)


def _convergence_count() -> float:
    for sample in metrics.CONVERGENCE_SECONDS.collect()[0].samples:
        if sample.name.endswith("_count") and sample.labels.get("api") == "sotw":
            return sample.value
    return 0.0


def test_an_ack_of_a_stamped_assignment_is_observed_as_convergence():
    before = _convergence_count()
    asyncio.run(_with_server(_two_eds_pushes))
    assert _convergence_count() == before + 1  # only b changed, and it was stamped
    assert metrics.SUBSCRIPTIONS.labels(type="eds", api="sotw")._value.get() == 0
