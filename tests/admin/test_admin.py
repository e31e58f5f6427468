"""Admin API over real HTTP (aiohttp test server), fed by a controller with a fake scraper."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest

from tests.control.test_controller import CONFIG, FakeScraper
from xds_server.admin.api import AdminApi
from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.control.explain import explain_rows
from xds_server.security.guard import StreamAccess
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nacks import NackLog
from xds_server.xds.protocol import SotwStream
from xds_server.xds.server import XdsServicer
from xds_server.xds.stream_info import StreamInfo


def _setup():
    scraper = FakeScraper()
    scraper.pct = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 80.0}  # q's endpoint is down
    cache = SnapshotCache()
    controller = Controller(CONFIG, cache, scraper=scraper, clock=lambda: 1000.0)
    servicer = XdsServicer(cache)
    nacks = NackLog(clock=lambda: 5.0)
    return controller, servicer, nacks


async def _run(body):
    controller, servicer, nacks = _setup()
    ready = {"value": False}
    api = AdminApi(controller, lambda: ready["value"], servicer, nacks)
    async with TestClient(TestServer(api.app())) as client:
        await body(client, controller, servicer, nacks, ready)


def test_health_and_readiness():
    async def body(client, controller, servicer, nacks, ready):
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        ready["value"] = True
        assert (await client.get("/readyz")).status == 200
    asyncio.run(_run(body))


def test_weights_document_shape():
    async def body(client, controller, servicer, nacks, ready):
        await controller.tick()
        doc = await (await client.get("/v1/weights")).json()
        p = doc["pools"]["p"]
        assert p["10.0.0.1:80"]["weight"] == 90 and p["10.0.0.2:80"]["weight"] == 60
        assert p["10.0.0.1:80"]["stale"] is False
        assert p["10.0.0.1:80"]["signals"]["gpu_mem_pct"] == 20.0
        assert isinstance(p["10.0.0.1:80"]["updated_at"], float)
        assert doc["pools"]["q"]["10.0.1.1:80"]["stale"] is True
        assert p["10.0.0.1:80"]["problems"] == []
        assert p["10.0.0.1:80"]["breakdown"]["inputs"] == {"gpu_mem_pct": 20.0}
        assert p["10.0.0.1:80"]["breakdown"]["capacity"] is None  # gpu_memory: no scaling
    asyncio.run(_run(body))


def test_snapshot_nacks_config_and_metrics():
    async def body(client, controller, servicer, nacks, ready):
        await controller.tick()
        machine = SotwStream()
        machine.receive(DiscoveryRequest(type_url=T.CLUSTER, node={"id": "envoy-7"}))
        [resp] = machine.responses(controller.cache.snapshot)
        info = StreamInfo("ipv4:127.0.0.1:5", "sotw", "ADS", machine)
        servicer.streams.add(info)
        events = machine.receive(DiscoveryRequest(type_url=T.CLUSTER, response_nonce=resp.nonce,
                                                  error_detail={"message": "bad cluster"}))
        nacks.observe(info, events[0])
        snap = await (await client.get("/v1/snapshot")).json()
        assert snap["streams"][0]["node"] == "envoy-7"
        assert set(snap["streams"][0]["types"]["cds"]["resources"]) == {"p", "q"}
        assert snap["current"]["types"]["eds"]["resources"].keys() == {"p", "q"}
        recent = await (await client.get("/v1/nacks")).json()
        assert recent["total"] == 1 and recent["recent"][0]["detail"] == "bad cluster"
        assert recent["recent"][0]["type"] == "cds" and recent["recent"][0]["node"] == "envoy-7"
        config = await (await client.get("/v1/config")).json()
        assert config["pools"][0]["name"] == "p"
        metrics = await (await client.get("/metrics")).text()
        assert 'trimtab_endpoint_weight{endpoint="10.0.0.1:80",pool="p"} 90.0' in metrics
        missing = await client.get("/v1/nope")
        assert missing.status == 404 and (await missing.json())["error"]["status"] == 404
    asyncio.run(_run(body))


STATIC = parse_config({
    "telemetry": {"source": "static", "stale_after_seconds": 3},
    "weights": {"policy": "composite"},
    "pools": [{"name": "s", "model": "m", "endpoints": [
        {"address": "10.0.2.1:80",
         "signals": {"kv_usage": 0.5, "queue": 8, "kv_capacity_tokens": 20000}},
        {"address": "10.0.2.2:80", "capacity": 10000,
         "signals": {"kv_usage": 0.2, "queue": 0, "gpu_util_pct": float("nan")}},
    ]}],
})


def test_weights_document_carries_the_breakdown_trimtab_weights_shows():
    async def scenario():
        controller = Controller(STATIC, SnapshotCache(), clock=lambda: 1000.0)
        api = AdminApi(controller, lambda: True)
        try:
            async with TestClient(TestServer(api.app())) as client:
                await controller.tick()
                return controller, await (await client.get("/v1/weights")).json()
        finally:
            await controller.close()

    controller, doc = asyncio.run(scenario())
    big, small = doc["pools"]["s"]["10.0.2.1:80"], doc["pools"]["s"]["10.0.2.2:80"]
    assert big["breakdown"]["normalised"] == {"memory": 0.5, "queue": 0.25}
    assert big["breakdown"]["mix"] == pytest.approx({"memory": 0.4 / 0.75, "queue": 0.35 / 0.75})
    assert big["breakdown"]["shares"] == pytest.approx({"memory": 0.4 / 1.5, "queue": 0.35})
    assert (big["breakdown"]["capacity"], big["breakdown"]["capacity_tokens"]) == (1.0, 20000.0)
    assert big["breakdown"]["inputs"]["capacity"] == 20000.0
    assert big["breakdown"]["target_weight"] == big["weight"] == 62
    assert (small["breakdown"]["capacity"], small["breakdown"]["capacity_tokens"]) == (0.5, 10000)
    assert small["weight"] == 45 and big["problems"] == []
    assert small["problems"] == ["gpu_util_pct: value nan rejected, outside [0, 100]"]
    assert "input problems: gpu_util_pct" in small["reason"]
    rows = {row["endpoint"]: row for row in explain_rows(controller)}
    for address, served in doc["pools"]["s"].items():
        row = rows[address]
        assert {k: served["breakdown"][k] for k in ("normalised", "shares")} == \
            {k: row[k] for k in ("normalised", "shares")}
        assert row["capacity"] == served["breakdown"]["capacity"]
        assert row["problems"] == served["problems"]


# -- hostile bytes over real HTTP ------------------------------------------------------------


async def _raw_http(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as raw bytes; (status, headers, body) of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def _request(method: str, path: bytes, *headers: bytes) -> bytes:
    lines = [method.encode() + b" " + path + b" HTTP/1.1", b"Host: trimtab",
             b"Content-Length: 0", b"Connection: close", *headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


TOKEN = b"s3cret-token"
JSON_TYPE = b"Content-Type: application/json"  # what a state-changing request needs
NON_ASCII_AUTH = [b"Authorization: Bearer s3cr\xe9t-token", b"Authorization: Bearer \xff\xfe",
                  b"Authorization: Bearer " + TOKEN + b"\xc3\xa9", b"Authorization: B\xe9arer x",
                  b"Authorization: \xe9"]


def test_non_ascii_authorization_gets_the_json_401_and_no_traceback(caplog):
    """Issue 12 §5: a non-ASCII byte in Authorization was a plain-text 500 and a traceback."""
    from xds_server.admin.api import start_admin

    async def scenario():
        controller, servicer, nacks = _setup()
        api = AdminApi(controller, lambda: True, servicer, nacks, token=TOKEN.decode(),
                       protect_reads=True)
        runner = await start_admin(api, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            answers = []
            for header in NON_ASCII_AUTH:
                for method, path in (("GET", b"/v1/weights"), ("POST", b"/v1/rollouts/p/pause")):
                    answers.append((header, *await _raw_http(port, _request(method, path, header))))
            ok = await _raw_http(port, _request("GET", b"/v1/weights",
                                                b"Authorization: Bearer " + TOKEN))
            return answers, ok
        finally:
            await runner.cleanup()
            await controller.close()

    with caplog.at_level("DEBUG"):
        answers, ok = asyncio.run(scenario())
    for header, status, headers, body in answers:
        assert status == 401, (header, status, body)
        assert headers["content-type"].startswith("application/json"), header
        assert headers["www-authenticate"].startswith("Bearer"), header
        assert json.loads(body)["error"]["status"] == 401
    assert ok[0] == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text


def test_other_hostile_bytes_get_a_4xx_and_no_traceback(caplog):
    """The same class of bug elsewhere: undecodable escapes in paths and queries, bytes that
    aiohttp cannot parse (these never reach a handler: 400, one log line, no traceback)."""
    from xds_server.admin.api import start_admin

    auth = b"Authorization: Bearer " + TOKEN
    cases = [
        (_request("POST", b"/v1/rollouts/%ff%fe/pause", auth, JSON_TYPE), {404}),
        (_request("POST", b"/v1/rollouts/p/%ff", auth, JSON_TYPE), {400, 404, 409}),
        (_request("GET", b"/v1/history?since=%ff%fe", auth), {400}),
        (_request("GET", b"/static/%ff.js", auth), {404}),
        (_request("GET", b"/v1/weights", auth, b"X-\xe9: 1"), {400}),
        (_request("GET", b"/v1/weights", auth, b"Host: \xe9\xff"), {400}),
        (_request("GET", b"/v1/\xe9\xff", auth), {400, 404}),
    ]

    async def scenario():
        controller, servicer, nacks = _setup()
        api = AdminApi(controller, lambda: True, servicer, nacks, token=TOKEN.decode(),
                       protect_reads=True)
        runner = await start_admin(api, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            return [await _raw_http(port, raw) for raw, _ in cases]
        finally:
            await runner.cleanup()
            await controller.close()

    with caplog.at_level("DEBUG"):
        answers = asyncio.run(scenario())
    for (raw, allowed), (status, _, body) in zip(cases, answers, strict=True):
        assert status in allowed, (raw, status, body)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
    assert "bad HTTP request from 127.0.0.1" in caplog.text


def test_snapshot_and_nacks_show_the_node_a_stream_was_authorised_as_and_who_sent_it():
    """A node id claimed after the first request is ignored: /v1/snapshot and /v1/nacks show
    the first request's, with the peer and the certificate identities next to it."""
    async def body(client, controller, servicer, nacks, ready):
        await controller.tick()
        machine = SotwStream()
        machine.receive(DiscoveryRequest(type_url=T.CLUSTER, node={"id": "edge-1"}))
        [resp] = machine.responses(controller.cache.snapshot)
        access = StreamAccess("ipv4:10.1.2.3:5000", ["spiffe://corp/cluster/edge/node/edge-1"])
        info = StreamInfo("ipv4:10.1.2.3:5000", "sotw", "ADS", machine, access)
        servicer.streams.add(info)
        events = machine.receive(DiscoveryRequest(
            type_url=T.CLUSTER, node={"id": "victim"}, response_nonce=resp.nonce,
            error_detail={"message": "bad cluster"}))
        nacks.observe(info, events[0])
        [stream] = (await (await client.get("/v1/snapshot")).json())["streams"]
        assert (stream["node"], stream["peer"], stream["identities"]) == (
            "edge-1", "ipv4:10.1.2.3:5000", ["spiffe://corp/cluster/edge/node/edge-1"])
        [record] = (await (await client.get("/v1/nacks")).json())["recent"]
        assert (record["node"], record["peer"], record["identities"]) == (
            "edge-1", "ipv4:10.1.2.3:5000", ["spiffe://corp/cluster/edge/node/edge-1"])
    asyncio.run(_run(body))
