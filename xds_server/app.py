"""Wires the parts together: cache, xDS gRPC server, controller loop and admin API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1.health import aio as health_aio

from .admin import AdminApi, start_admin, weights_document
from .cache import SnapshotCache
from .config import Config, ConfigError, load_config
from .controller import Controller
from .discovery import Discovery
from .grpc_extras import XDS_SERVICE_NAMES, add_health_and_reflection, set_serving
from .history import WeightHistory
from .keda.scaler import ExternalScalerServicer, start_scaler_server
from .nack_log import NackLog
from .security import (
    NodeAuthorizer,
    RateLimiter,
    SnapshotViews,
    XdsGuard,
    load_token,
    server_credentials,
    server_options,
)
from .transport import XdsServicer, start_xds_server

log = logging.getLogger("trimtab")

SHUTDOWN_GRACE_S = 2.0


def state_file_path(config: Config, config_path: str | Path | None) -> Path:
    path = Path(config.rollouts.state_file)
    if not path.is_absolute() and config_path is not None:
        path = Path(config_path).resolve().parent / path
    return path


class Trimtab:
    """One control plane. `start()`, then `run(stop)` until `stop` is set."""

    def __init__(self, config: Config, config_path: str | Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.cache = SnapshotCache()
        self.controller = Controller(config, self.cache, state_file=state_file_path(config, config_path))
        self.history = WeightHistory.for_interval(config.telemetry.interval_seconds)
        self.controller.on_tick_off_loop.append(self._prepare_history)
        self.discovery = Discovery(self._apply_discovered)
        self.nacks = NackLog()
        limits = config.xds.limits
        self.guard = XdsGuard(
            NodeAuthorizer.from_config(config.nodes),
            RateLimiter(limits.requests_per_second, limits.request_burst)
            if limits.requests_per_second is not None else None,
            SnapshotViews(lambda: (self.controller.config, self.controller.canary_percent)))
        self.servicer = XdsServicer(self.cache, on_event=self.nacks.observe, guard=self.guard)
        self._grpc: grpc.aio.Server | None = None
        self.xds_port: int | None = None
        self.scaler_port: int | None = None
        self._scaler: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._admin: web.AppRunner | None = None

    def ready(self) -> bool:
        return self.controller.stats.ticks > 0 and self.cache.snapshot is not None

    async def start(self) -> None:
        def extras(server: grpc.aio.Server) -> None:
            self._health = add_health_and_reflection(server, list(XDS_SERVICE_NAMES))

        xds = self.config.xds
        credentials = (server_credentials(xds.tls.cert_file, xds.tls.key_file,
                                          xds.tls.client_ca_file, xds.tls.require_client_cert,
                                          reload=xds.tls.reload)
                       if xds.tls is not None else None)
        options = server_options(xds.limits.max_streams_per_connection,
                                 xds.limits.max_request_bytes,
                                 xds.limits.max_connection_age_seconds,
                                 xds.limits.max_connection_age_grace_seconds)
        self._grpc, self.xds_port = await start_xds_server(
            self.servicer, xds.address, configure=extras, credentials=credentials,
            options=options, maximum_concurrent_rpcs=xds.limits.max_streams)
        assert self._health is not None
        await set_serving(self._health, list(XDS_SERVICE_NAMES), False)
        if self.config.keda.address is not None:
            scaler = ExternalScalerServicer(self.controller.autoscaler.source)
            self._scaler, self.scaler_port = await start_scaler_server(scaler,
                                                                       self.config.keda.address)
        admin = self.config.admin.host_port
        auth = self.config.admin.auth
        api = AdminApi(self.controller, self.ready, self.servicer, self.nacks, self.history,
                       token=load_token(auth.token_file, auth.token_env),
                       protect_reads=auth.protect_reads)
        self._admin = await start_admin(api, admin.host, admin.port)
        self.discovery.start(self.config)
        log.info("trimtab serving xDS on %s, admin on %s, %d pools", self.config.xds.address,
                 self.config.admin.address, len(self.config.pools))

    async def run(self, stop: asyncio.Event) -> None:
        serving = asyncio.create_task(self._mark_serving_when_ready(stop))
        try:
            await self.controller.run(stop)
        finally:
            serving.cancel()
            await self.close()

    async def _mark_serving_when_ready(self, stop: asyncio.Event) -> None:
        """gRPC health follows /readyz: SERVING once the first snapshot is published."""
        while not self.ready() and not stop.is_set():
            await asyncio.sleep(0.05)
        if self._health is not None and not stop.is_set():
            await set_serving(self._health, list(XDS_SERVICE_NAMES), True)

    async def reload(self) -> bool:
        """Re-read the config file. A bad file is reported and the last good config stays."""
        if self.config_path is None:
            return False
        try:
            config = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload refused, keeping the last good config:\n%s", exc)
            return False
        for key in ("xds", "admin"):
            if getattr(config, key) != getattr(self.config, key):
                log.warning("reload: %s.address changes need a restart; keeping %s", key,
                            getattr(self.config, key).address)
        self.config = config.model_copy(update={"xds": self.config.xds, "admin": self.config.admin})
        self.guard.update(NodeAuthorizer.from_config(self.config.nodes))
        await self.discovery.close()
        await self.controller.reload(self.discovery.effective(self.config))
        self.discovery.start(self.config)
        log.info("reloaded config from %s", self.config_path)
        return True

    def _prepare_history(self) -> Callable[[], None]:
        """On the telemetry worker: the weights document (CPU-heavy at fleet scale, reads
        only what a tick replaces); the loop then records it."""
        at, document = self.controller.clock(), weights_document(self.controller)
        return lambda: self.history.record(at, document)

    def _apply_discovered(self, config: Config) -> None:
        self.controller.apply_config(config)
        self.controller.publish()

    async def close(self) -> None:
        await self.discovery.close()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._scaler is not None:
            await self._scaler.stop(SHUTDOWN_GRACE_S)
            self._scaler = None
        self.servicer.close_streams()
        if self._grpc is not None:
            await self._grpc.stop(SHUTDOWN_GRACE_S)
            self._grpc = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        await self.controller.close()
