"""Health checking and reflection next to the xDS services, with real grpcio clients."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from xds_server.xds.cache import SnapshotCache
from xds_server.xds.health import (
    HEALTH_SERVICE_NAME,
    XDS_SERVICE_NAMES,
    add_health_and_reflection,
    set_serving,
)
from xds_server.xds.server import XdsServicer

ADS = "envoy.service.discovery.v3.AggregatedDiscoveryService"


async def _with_server(body) -> None:
    servicer = XdsServicer(SnapshotCache())
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(tuple(servicer.handlers()))
    health = add_health_and_reflection(server, list(XDS_SERVICE_NAMES))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(channel, health)
    finally:
        await server.stop(None)


def test_xds_service_names_match_the_servicer():
    handlers = XdsServicer(SnapshotCache()).handlers()
    assert sorted(XDS_SERVICE_NAMES) == sorted(h.service_name() for h in handlers)


def test_health_check_serving_then_not_serving():
    async def body(channel, health):
        stub = health_pb2_grpc.HealthStub(channel)

        async def status(service: str) -> int:
            request = health_pb2.HealthCheckRequest(service=service)
            return (await stub.Check(request, timeout=5)).status

        assert await status("") == health_pb2.HealthCheckResponse.SERVING
        assert await status(ADS) == health_pb2.HealthCheckResponse.SERVING
        await set_serving(health, [ADS], serving=False)
        assert await status(ADS) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await status("no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    asyncio.run(_with_server(body))


def test_health_watch_sees_graceful_shutdown():
    async def body(channel, health):
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        await health.enter_graceful_shutdown()
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    asyncio.run(_with_server(body))


async def _reflect(channel, request: reflection_pb2.ServerReflectionRequest):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter([request]), timeout=5)
    return [response async for response in call][0]


def test_reflection_lists_xds_health_and_reflection():
    async def body(channel, health):
        response = await _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in response.list_services_response.service}
        assert names == {*XDS_SERVICE_NAMES, HEALTH_SERVICE_NAME,
                         "grpc.reflection.v1alpha.ServerReflection"}
    asyncio.run(_with_server(body))


def test_reflection_describes_the_generic_xds_services():
    async def body(channel, health):
        for service, method in [(ADS, "DeltaAggregatedResources"),
                                ("envoy.service.route.v3.RouteDiscoveryService", "StreamRoutes")]:
            request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)
            response = await _reflect(channel, request)
            assert not response.HasField("error_response"), response.error_response
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in response.file_descriptor_response.file_descriptor_proto]
            methods = {f"{f.package}.{s.name}": {m.name for m in s.method}
                       for f in files for s in f.service}
            assert method in methods[service]
    asyncio.run(_with_server(body))
