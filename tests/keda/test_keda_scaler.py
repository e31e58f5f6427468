"""The KEDA External Scaler with a real grpcio client against the real server (free port)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from tests.support.paths import ROOT
from xds_server.keda import (
    ExternalScalerServicer,
    InMemoryScaleSource,
    PoolScale,
    metric_name,
    start_scaler_server,
)
from xds_server.keda import externalscaler_pb2 as pb2
from xds_server.keda import externalscaler_pb2_grpc as pb2_grpc


def ref(pool: str | None = "llama3-8b", **extra: str) -> pb2.ScaledObjectRef:
    metadata = dict(extra)
    if pool is not None:
        metadata["pool"] = pool
    return pb2.ScaledObjectRef(name="vllm", namespace="models", scalerMetadata=metadata)


async def _with_scaler(body) -> None:
    source = InMemoryScaleSource({"llama3-8b": PoolScale(desired_replicas=3, score=0.85),
                                  "idle": PoolScale(desired_replicas=0, score=0.0)})
    server, port = await start_scaler_server(ExternalScalerServicer(source), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await body(pb2_grpc.ExternalScalerStub(channel), source)
    finally:
        await server.stop(None)


def run(body) -> None:
    asyncio.run(_with_scaler(body))


def test_get_metric_spec_targets_one_replica_per_unit():
    async def body(stub, source):
        resp = await stub.GetMetricSpec(ref(scalerAddress="trimtab:19200"), timeout=5)
        assert [(s.metricName, s.targetSize, s.targetSizeFloat) for s in resp.metricSpecs] == [
            ("trimtab-llama3-8b-desired-replicas", 1, 1.0)]
    run(body)


def test_get_metrics_reports_desired_replicas_and_follows_the_source():
    async def body(stub, source):
        request = pb2.GetMetricsRequest(scaledObjectRef=ref(), metricName=metric_name("llama3-8b"))
        resp = await stub.GetMetrics(request, timeout=5)
        assert [(v.metricName, v.metricValue, v.metricValueFloat) for v in resp.metricValues] == [
            ("trimtab-llama3-8b-desired-replicas", 3, 3.0)]
        source.update("llama3-8b", PoolScale(desired_replicas=7, score=0.9))
        resp = await stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=ref()), timeout=5)
        assert resp.metricValues[0].metricValue == 7
    run(body)


def test_is_active():
    async def body(stub, source):
        assert (await stub.IsActive(ref(), timeout=5)).result is True
        assert (await stub.IsActive(ref("idle"), timeout=5)).result is False
        source.update("idle", PoolScale(desired_replicas=0, active=True))
        assert (await stub.IsActive(ref("idle"), timeout=5)).result is True
    run(body)


def test_stream_is_active_sends_current_then_each_flip():
    async def body(stub, source):
        call = stub.StreamIsActive(ref())
        assert (await asyncio.wait_for(call.read(), 5)).result is True
        # a change that leaves `active` alone sends nothing ...
        source.update("llama3-8b", PoolScale(desired_replicas=4, score=0.95))
        await asyncio.sleep(0.05)
        # ... so the next message is the flip, not a repeat of True
        source.update("llama3-8b", PoolScale(desired_replicas=0, score=0.1))
        assert (await asyncio.wait_for(call.read(), 5)).result is False
        source.update("llama3-8b", PoolScale(desired_replicas=1))
        assert (await asyncio.wait_for(call.read(), 5)).result is True
        call.cancel()
    run(body)


def test_stream_is_active_ends_not_found_when_the_pool_goes_away():
    async def body(stub, source):
        call = stub.StreamIsActive(ref())
        assert (await asyncio.wait_for(call.read(), 5)).result is True
        source.remove("llama3-8b")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    run(body)


@pytest.mark.parametrize("bad_ref, needle", [
    (ref(None, scalerAddress="x:1"), "scalerMetadata.pool is required"),
    (ref(""), "expected a pool name"),
    (ref("llama 3"), "expected a pool name"),
])
def test_missing_or_malformed_pool_is_invalid_argument(bad_ref, needle):
    async def body(stub, source):
        calls = [stub.IsActive(bad_ref, timeout=5), stub.GetMetricSpec(bad_ref, timeout=5),
                 stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=bad_ref), timeout=5)]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details()
        stream = stub.StreamIsActive(bad_ref)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream.read(), 5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    run(body)


def test_get_metrics_without_ref_or_with_a_foreign_metric_is_invalid_argument():
    async def body(stub, source):
        for request, needle in [
            (pb2.GetMetricsRequest(metricName="x"), "scaledObjectRef is required"),
            (pb2.GetMetricsRequest(scaledObjectRef=ref(), metricName="s0-other"),
             "unknown metricName"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetMetrics(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in info.value.details()
    run(body)


def test_unknown_pool_is_not_found_on_every_rpc():
    async def body(stub, source):
        unknown = ref("mistral-7b")
        calls = [stub.IsActive(unknown, timeout=5), stub.GetMetricSpec(unknown, timeout=5),
                 stub.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=unknown), timeout=5)]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "mistral-7b" in info.value.details()
        stream = stub.StreamIsActive(unknown)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stream.read(), 5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    run(body)


def test_an_unknown_pool_error_names_the_pool_and_a_count_not_every_pool():
    async def body():
        source = InMemoryScaleSource({f"secret-pool-{i}": PoolScale(1) for i in range(50)})
        server, port = await start_scaler_server(ExternalScalerServicer(source), "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb2_grpc.ExternalScalerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.IsActive(ref("mistral-7b"), timeout=5)
        finally:
            await server.stop(None)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        details = info.value.details()
        assert "'mistral-7b'" in details and "50 pools" in details
        assert "secret-pool" not in details
    asyncio.run(body())


def _oversized():
    from xds_server.keda import bounds

    many = {f"k{i}": "v" for i in range(bounds.MAX_METADATA_ENTRIES)}
    long_name = "n" * (bounds.MAX_NAME_CHARS + 1)
    return [
        (ref(**many), f"scalerMetadata: {bounds.MAX_METADATA_ENTRIES + 1} entries, over the "
                      f"limit of {bounds.MAX_METADATA_ENTRIES}"),
        (ref(**{"k" * 300: "v"}), f"scalerMetadata key: 300 chars, over the limit of "
                                  f"{bounds.MAX_METADATA_KEY_CHARS}"),
        (ref(caCert="c" * (bounds.MAX_METADATA_VALUE_CHARS + 1)),
         f"scalerMetadata['caCert']: {bounds.MAX_METADATA_VALUE_CHARS + 1} chars, over the "
         f"limit of {bounds.MAX_METADATA_VALUE_CHARS}"),
        (pb2.ScaledObjectRef(name=long_name, namespace="m", scalerMetadata={"pool": "idle"}),
         f"scaledObjectRef.name: {bounds.MAX_NAME_CHARS + 1} chars, over the limit of "
         f"{bounds.MAX_NAME_CHARS}"),
        (ref("p" * (bounds.MAX_POOL_CHARS + 1)), f"at most {bounds.MAX_POOL_CHARS} chars"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_metadata_over_its_bounds_is_invalid_argument_naming_field_and_limit(case):
    bad_ref, needle = _oversized()[case]

    async def body(stub, source):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetMetricSpec(bad_ref, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()
        assert len(info.value.details()) < 300  # a peer's string is quoted bounded
    run(body)


def test_a_long_metric_name_and_control_characters_are_refused_bounded_and_escaped():
    async def body(stub, source):
        request = pb2.GetMetricsRequest(scaledObjectRef=ref(), metricName="m" * 10_000)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetMetrics(request, timeout=5)
        assert info.value.details() == "metricName: 10000 chars, over the limit of 512"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.IsActive(ref("a\nfake log line\x1b[31m" + "x" * 200), timeout=5)
        details = info.value.details()
        assert "\n" not in details and "\x1b" not in details
        assert "'a\\nfake log line\\x1b[31m" in details and "(220 chars)" in details
    run(body)


def test_a_message_over_the_limit_is_refused_by_grpc():
    from xds_server.keda.bounds import MAX_MESSAGE_BYTES

    async def body(stub, source):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.IsActive(ref(big="b" * MAX_MESSAGE_BYTES), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    run(body)


def test_a_port_in_use_is_an_error():
    async def body():
        source = InMemoryScaleSource()
        server, port = await start_scaler_server(ExternalScalerServicer(source), "127.0.0.1:0")
        try:
            with pytest.raises(OSError, match="cannot bind"):
                await start_scaler_server(ExternalScalerServicer(source), f"127.0.0.1:{port}")
        finally:
            await server.stop(None)
    asyncio.run(body())


# KEDA's pkg/scalers/externalscaler/externalscaler.proto: message -> {field: number}
KEDA_FIELDS = {
    "ScaledObjectRef": {"name": 1, "namespace": 2, "scalerMetadata": 3},
    "IsActiveResponse": {"result": 1},
    "GetMetricSpecResponse": {"metricSpecs": 1},
    "MetricSpec": {"metricName": 1, "targetSize": 2, "targetSizeFloat": 3},
    "GetMetricsRequest": {"scaledObjectRef": 1, "metricName": 2},
    "GetMetricsResponse": {"metricValues": 1},
    "MetricValue": {"metricName": 1, "metricValue": 2, "metricValueFloat": 3},
}


def test_proto_matches_kedas_contract():
    file = pb2.DESCRIPTOR
    assert file.package == "externalscaler"
    service = file.services_by_name["ExternalScaler"]
    assert sorted(m.name for m in service.methods) == [
        "GetMetricSpec", "GetMetrics", "IsActive", "StreamIsActive"]
    assert service.methods_by_name["StreamIsActive"].server_streaming
    for message, fields in KEDA_FIELDS.items():
        got = {f.name: f.number for f in file.message_types_by_name[message].fields}
        assert got == fields, message


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="needs grpcio-tools")
def test_committed_stubs_match_regeneration(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=120)
    names = ["externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    for name in names:
        committed = (ROOT / "xds_server" / "keda" / name).read_text()
        assert (tmp_path / name).read_text() == committed, f"{name} is stale: run scripts/gen_protos.sh"
