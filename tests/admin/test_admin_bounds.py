"""Issue 26 finding 4: admin work and admin connections must not stall xDS.

Documents are built off the event loop, once per version for any number of readers, and
bounded in bytes; connections have header-read and idle timeouts and per-client and total
caps; running out of descriptors is logged in a throttled line; the port is never shared."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import threading
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest

from trimtab_dev.envoy_process import free_port
from xds_server.admin.api import AdminApi, start_admin
from xds_server.admin.encoding import DocumentLimits
from xds_server.admin.history import WeightHistory
from xds_server.admin.serving import ConnectionLimits, Throttled, quiet_accept_errors
from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nacks import NackLog
from xds_server.xds.protocol import Nack, SotwStream
from xds_server.xds.server import XdsServicer
from xds_server.xds.stream_info import StreamInfo

POOLS, PER_POOL = 2, 1500  # 3,000 endpoints: /v1/weights is about 2 MB


def fleet_config(pools: int = POOLS, per_pool: int = PER_POOL) -> Any:
    return parse_config({
        "telemetry": {"source": "static", "stale_after_seconds": 30},
        "weights": {"policy": "composite"},
        "pools": [{"name": f"pool{p}", "model": f"model{p}", "endpoints": [
            {"address": f"10.{p}.{i // 250}.{i % 250 + 1}:8000",
             "signals": {"kv_usage": (i % 10) / 10, "queue": i % 7}}
            for i in range(per_pool)]} for p in range(pools)],
    })


async def _fleet_client(limits: DocumentLimits | None = None, **kwargs: Any
                        ) -> tuple[Controller, AdminApi, TestClient]:
    controller = Controller(fleet_config(**kwargs), SnapshotCache(), clock=lambda: 1000.0)
    await controller.tick()
    api = AdminApi(controller, lambda: True, XdsServicer(controller.cache), limits=limits)
    client = TestClient(TestServer(api.app()))
    await client.start_server()
    return controller, api, client


# -- documents: off the loop, once per version --------------------------------------------


def test_concurrent_weights_readers_cost_one_build_on_the_admin_thread():
    """Eight readers of one version: one build, on a thread that is not the loop's; the
    loop answers /healthz while it runs. A new tick (new weights) is one more build."""
    async def scenario() -> dict[str, Any]:
        controller, api, client = await _fleet_client()
        builds: list[tuple[str, int]] = []
        api.worker.on_build.append(lambda name: builds.append((name, threading.get_ident())))
        try:
            readers = [asyncio.ensure_future(client.get("/v1/weights")) for _ in range(8)]
            await asyncio.sleep(0)
            health = await client.get("/healthz")
            answers = [await r for r in readers]
            bodies = [await a.read() for a in answers]
            first = list(builds)
            await controller.tick()
            again = await (await client.get("/v1/weights")).read()
            return {"loop": threading.get_ident(), "first": first, "all": list(builds),
                    "bodies": bodies, "statuses": [a.status for a in answers],
                    "health": health.status, "again": again}
        finally:
            await client.close()
            await controller.close()

    out = asyncio.run(scenario())
    assert out["statuses"] == [200] * 8 and out["health"] == 200
    assert [name for name, _ in out["first"]] == ["weights"]  # eight readers, one build
    assert all(thread != out["loop"] for _, thread in out["all"])
    assert len(set(out["bodies"])) == 1
    doc = json.loads(out["bodies"][0])
    assert sum(len(eps) for eps in doc["pools"].values()) == POOLS * PER_POOL
    assert [name for name, _ in out["all"]] == ["weights", "weights"]  # the tick's new version
    assert json.loads(out["again"])["pools"].keys() == doc["pools"].keys()


def test_every_growing_document_is_encoded_on_the_admin_thread():
    async def scenario() -> tuple[int, set[tuple[str, int]], list[int]]:
        controller, api, client = await _fleet_client(pools=1, per_pool=10)
        builds: set[tuple[str, int]] = set()
        api.worker.on_build.append(lambda name: builds.add((name, threading.get_ident())))
        try:
            statuses = [(await client.get(path)).status for path in (
                "/v1/weights", "/v1/weights?pool=pool0", "/v1/snapshot", "/v1/nacks",
                "/v1/config", "/v1/history")]
            return threading.get_ident(), builds, statuses
        finally:
            await client.close()
            await controller.close()

    loop, builds, statuses = asyncio.run(scenario())
    assert statuses == [200] * 6
    assert {name for name, _ in builds} == {"weights", "snapshot", "nacks", "config", "history"}
    assert loop not in {thread for _, thread in builds}


# -- documents: bounded in bytes -----------------------------------------------------------


def test_weights_over_its_limit_is_a_413_that_names_the_limit_and_pool():
    async def scenario() -> list[tuple[int, Any]]:
        controller, api, client = await _fleet_client(
            DocumentLimits(weights_bytes=1_200_000), pools=2, per_pool=1500)
        try:
            out = []
            for path in ("/v1/weights", "/v1/weights?pool=pool1", "/v1/weights?pool=nope"):
                response = await client.get(path)
                out.append((response.status, await response.json()))
            return out
        finally:
            await client.close()
            await controller.close()

    (whole, whole_doc), (one, one_doc), (missing, missing_doc) = asyncio.run(scenario())
    message = whole_doc["error"]["message"]
    assert whole == 413 and "over its limit of 1200000 bytes" in message
    assert "?pool=NAME (pools: pool0, pool1)" in message
    assert one == 200 and set(one_doc["pools"]) == {"pool1"}
    assert len(one_doc["pools"]["pool1"]) == 1500
    assert missing == 404 and "no pool 'nope'" in missing_doc["error"]["message"]


def _stream(node: str) -> StreamInfo:
    machine = SotwStream()
    machine.receive(DiscoveryRequest(type_url=T.CLUSTER, node={"id": node}))
    return StreamInfo(f"ipv4:127.0.0.1:{len(node)}", "sotw", "ADS", machine)


def test_nacks_snapshot_and_history_keep_the_newest_that_fit_their_limit():
    limits = DocumentLimits(nacks_bytes=64_000, snapshot_bytes=16_000, history_bytes=40_000)

    async def scenario() -> dict[str, bytes]:
        controller = Controller(fleet_config(pools=1, per_pool=200), SnapshotCache(),
                                clock=lambda: 1000.0)
        await controller.tick()
        nacks = NackLog(clock=lambda: 5.0)
        servicer = XdsServicer(controller.cache)
        for i in range(100):
            nacks.observe(_stream(f"node-{i}"), Nack(T.CLUSTER, str(i), "v1", "x" * 3000, {}))
        for i in range(200):
            servicer.streams.add(_stream(f"envoy-{i:03d}"))
        history = WeightHistory(max_points=50)
        weights = {"pools": {"p": {f"10.0.0.{i}:80": {"weight": i, "stale": False}
                                   for i in range(200)}}}
        for at in range(50):
            history.record(float(at), weights)
        api = AdminApi(controller, lambda: True, servicer, nacks, history, limits=limits)
        try:
            async with TestClient(TestServer(api.app())) as client:
                return {path: await (await client.get(path)).read() for path in (
                    "/v1/nacks", "/v1/snapshot", "/v1/snapshot?node=envoy-007", "/v1/history")}
        finally:
            await controller.close()

    out = asyncio.run(scenario())
    nacks = json.loads(out["/v1/nacks"])
    assert len(out["/v1/nacks"]) <= limits.nacks_bytes
    assert nacks["total"] == 100 and nacks["left_out"] == 100 - len(nacks["recent"]) > 0
    assert nacks["recent"][0]["node"] == "node-99"  # newest first
    assert "left out to stay within" in nacks["left_out_hint"]
    snap = json.loads(out["/v1/snapshot"])
    assert len(out["/v1/snapshot"]) <= limits.snapshot_bytes
    assert snap["left_out"] == 200 - len(snap["streams"]) > 0
    assert "?node=ID" in snap["left_out_hint"]
    assert snap["streams"][0]["node"] == "envoy-000" and snap["current"] is not None
    [one] = json.loads(out["/v1/snapshot?node=envoy-007"])["streams"]
    assert one["node"] == "envoy-007"
    history = json.loads(out["/v1/history"])
    assert len(out["/v1/history"]) <= limits.history_bytes
    assert history["left_out"] == 50 - len(history["points"]) > 0
    assert history["points"][-1]["at"] == 49.0 and history["latest_at"] == 49.0


# -- connections ---------------------------------------------------------------------------


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before closing; fails if it has not closed within ``seconds``."""
    data = b""
    deadline = time.monotonic() + seconds
    while True:
        try:
            chunk = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


async def _get(port: int, path: str = "/healthz", local: str | None = None) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, local_addr=(local, 0) if local else None)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
    try:
        return await _closed_within(reader, 5)
    finally:
        writer.close()


async def _admin(limits: ConnectionLimits) -> tuple[Controller, Any, int]:
    controller = Controller(fleet_config(pools=1, per_pool=2), SnapshotCache())
    runner = await start_admin(AdminApi(controller, lambda: True), "127.0.0.1", 0, limits)
    return controller, runner, runner.addresses[0][1]


async def _trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """A slowloris: one byte every 50 ms, for as long as the connection takes them."""
    try:
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        pass


def test_a_slowloris_is_closed_after_the_header_timeout_and_an_idle_one_after_idle():
    """The trickled header is cut at the header timeout, well before the idle timeout (which
    is also aiohttp's keep-alive timeout, the only one it had)."""
    limits = ConnectionLimits(header_timeout_s=0.3, idle_timeout_s=2.0)

    async def scenario() -> dict[str, Any]:
        controller, runner, port = await _admin(limits)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            trickle = asyncio.ensure_future(_trickle(
                writer, b"GET /healthz HTTP/1.1\r\n" + b"X-Slow: 1\r\n" * 40))
            slow = await _closed_within(reader, 10)
            slow_s = time.monotonic() - started
            trickle.cancel()
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # one request, then idle
            started = time.monotonic()
            idle = await _closed_within(reader, 10)
            idle_s = time.monotonic() - started
            writer.close()
            return {"slow": slow, "slow_s": slow_s, "idle": idle, "idle_s": idle_s,
                    "after": await _get(port)}
        finally:
            await runner.cleanup()
            await controller.close()

    out = asyncio.run(scenario())
    assert out["slow"] == b"" and 0.25 <= out["slow_s"] < 1.8
    assert out["idle"].startswith(b"HTTP/1.1 200") and 1.9 <= out["idle_s"] < 10
    assert out["after"].startswith(b"HTTP/1.1 200")


def test_a_client_over_its_connection_cap_is_refused_while_another_gets_healthz():
    limits = ConnectionLimits(max_per_peer=3, max_total=5, header_timeout_s=30)

    async def scenario() -> dict[str, Any]:
        controller, runner, port = await _admin(limits)
        held = []
        try:
            for _ in range(3):  # the hog: three idle connections from 127.0.0.1
                held.append(await asyncio.open_connection("127.0.0.1", port))
            await asyncio.sleep(0.05)
            refused = await _get(port)
            other = await _get(port, local="127.0.0.2")
            for local in ("127.0.0.3", "127.0.0.4"):  # five in all: the total cap
                held.append(await asyncio.open_connection("127.0.0.1", port,
                                                          local_addr=(local, 0)))
            await asyncio.sleep(0.05)
            full = await _get(port, local="127.0.0.5")
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            return {"refused": refused, "other": other, "full": full, "again": await _get(port)}
        finally:
            await runner.cleanup()
            await controller.close()

    out = asyncio.run(scenario())
    assert out["refused"].startswith(b"HTTP/1.1 503")
    message = json.loads(out["refused"].partition(b"\r\n\r\n")[2])["error"]["message"]
    assert "from 127.0.0.1: 3 open" in message and "(max_per_peer)" in message
    assert out["other"].startswith(b"HTTP/1.1 200")
    assert out["full"].startswith(b"HTTP/1.1 503") and b"(max_total)" in out["full"]
    assert out["again"].startswith(b"HTTP/1.1 200")  # closing frees the slots


def test_the_admin_port_cannot_be_shared():
    """A second admin server, or an impostor asking for SO_REUSEPORT, cannot bind the port."""
    async def scenario() -> tuple[int | None, int | None]:
        controller = Controller(fleet_config(pools=1, per_pool=2), SnapshotCache())
        port = free_port()
        runner = await start_admin(AdminApi(controller, lambda: True), "127.0.0.1", port)
        try:
            try:
                second = await start_admin(AdminApi(controller, lambda: True), "127.0.0.1", port)
                await second.cleanup()
                again = None
            except OSError as exc:
                again = exc.errno
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                    sock.listen()
                    impostor = None
                except OSError as exc:
                    impostor = exc.errno
            return again, impostor
        finally:
            await runner.cleanup()
            await controller.close()

    assert asyncio.run(scenario()) == (errno.EADDRINUSE, errno.EADDRINUSE)


def test_running_out_of_descriptors_is_one_throttled_line_without_a_traceback(caplog):
    other: list[dict[str, Any]] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: other.append(context))
        restore = quiet_accept_errors(loop, Throttled(logging.getLogger("trimtab.admin"), 60))
        for _ in range(500):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE,
                                                              "Too many open files")})
        loop.call_exception_handler({"message": "something else"})
        restore()
        loop.call_exception_handler({"message": "after restore"})

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if "out of system resource" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert "EMFILE (Too many open files)" in lines[0].getMessage()
    assert [c["message"] for c in other] == ["something else", "after restore"]
    assert "Traceback" not in caplog.text


def test_throttled_says_how_many_lines_it_left_out():
    now = [0.0]
    logger = logging.getLogger("trimtab.test.throttled")
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger.addHandler(Keep())
    say = Throttled(logger, 10, clock=lambda: now[0])
    for _ in range(5):
        say("k", logging.WARNING, "refused")
    now[0] = 11.0
    say("k", logging.WARNING, "refused")
    assert records == ["refused", "refused (4 more like it in the last 10 s)"]


@pytest.mark.parametrize("field", ["header_timeout_s", "idle_timeout_s", "max_per_peer",
                                   "max_total"])
def test_connection_limits_must_be_positive(field: str):
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        ConnectionLimits(**{field: 0})


def test_build_cache_keeps_only_versioned_builds_and_never_a_failed_one():
    from xds_server.admin.builds import AdminWorker, BuildCache

    async def scenario() -> tuple[list[str], int, list[str]]:
        worker = AdminWorker()
        cache: BuildCache[str] = BuildCache(worker)
        calls: list[str] = []

        def job(value: str, fail: bool = False):
            async def make():
                def work() -> str:
                    calls.append(value)
                    if fail:
                        raise RuntimeError("boom")
                    return value
                return work
            return make

        version = (object(),)
        got = [await cache.get(("a", None), version, job("v1")),
               await cache.get(("a", None), version, job("v1 again")),  # reused
               await cache.get(("b", "x"), None, job("live")),
               await cache.get(("b", "x"), None, job("live again"))]  # not kept once done
        with pytest.raises(RuntimeError):
            await cache.get(("c", None), version, job("bad", fail=True))
        got.append(await cache.get(("c", None), version, job("good")))
        held = len(cache._entries)
        worker.close()
        return got, held, calls

    got, held, calls = asyncio.run(scenario())
    assert got == ["v1", "v1", "live", "live again", "good"]
    assert calls == ["v1", "live", "live again", "bad", "good"]
    assert held == 2  # "a" and "c"; the unversioned "b" was dropped
