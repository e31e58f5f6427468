"""No listener trimtab opens can be shared: a second socket that asks for SO_REUSEPORT (as an
impostor of the same user would, to receive a share of the connections) cannot bind the port
of the xDS server, the admin API, the KEDA scaler or the intent classifier."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from unittest.mock import MagicMock

import pytest

from trimtab_dev.envoy_process import free_port
from xds_server.admin.api import AdminApi, start_admin
from xds_server.classify import ExtProcService, RulesClassifier, build_server
from xds_server.config.schema import ClassifierConfig, ClassifierRuleConfig
from xds_server.keda import ExternalScalerServicer, InMemoryScaleSource, start_scaler_server
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.server import XdsServicer, start_xds_server


def impostor_bind_error(port: int) -> int | None:
    """The errno of binding 127.0.0.1:`port` with SO_REUSEPORT (and SO_REUSEADDR) set, or
    None when the bind succeeds: the port would be shared."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError as exc:
            return exc.errno
    return None


@asynccontextmanager
async def xds() -> AsyncIterator[int]:
    server, port = await start_xds_server(XdsServicer(SnapshotCache()), "127.0.0.1:0")
    try:
        yield port
    finally:
        await server.stop(None)


@asynccontextmanager
async def keda() -> AsyncIterator[int]:
    servicer = ExternalScalerServicer(InMemoryScaleSource())
    server, port = await start_scaler_server(servicer, "127.0.0.1:0")
    try:
        yield port
    finally:
        await server.stop(None)


@asynccontextmanager
async def classifier() -> AsyncIterator[int]:
    limits = ClassifierConfig(address="127.0.0.1:18081",  # not used: bound below
                              rules=[ClassifierRuleConfig(tier="code", keywords=["python"])])
    server, port = build_server(ExtProcService(RulesClassifier(limits.rules), limits),
                                f"127.0.0.1:{free_port()}")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


@asynccontextmanager
async def admin() -> AsyncIterator[int]:
    port = free_port()  # aiohttp reports no bound port
    runner = await start_admin(AdminApi(MagicMock(), lambda: True), "127.0.0.1", port)
    try:
        yield port
    finally:
        await runner.cleanup()


LISTENERS: dict[str, Callable[[], object]] = {
    "xds": xds, "admin": admin, "keda": keda, "classifier": classifier}


@pytest.mark.parametrize("name", sorted(LISTENERS))
def test_a_second_bind_with_so_reuseport_fails(name: str) -> None:
    async def scenario() -> int | None:
        opened: Callable[[], Awaitable[object]] = LISTENERS[name]  # type: ignore[assignment]
        async with opened() as port:  # type: ignore[attr-defined]
            return await asyncio.to_thread(impostor_bind_error, port)

    assert asyncio.run(scenario()) == errno.EADDRINUSE, (
        f"the {name} port can be shared with another process")
