"""Wires the parts together: cache, xDS gRPC server (ADS and Envoy's load reports), controller
loop and admin API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1.health import aio as health_aio

from xds_server.admin.api import AdminApi, start_admin
from xds_server.admin.documents import weights_summary
from xds_server.admin.history import WeightHistory, history_point
from xds_server.classify_server import EmbeddedClassifier
from xds_server.config.load import ConfigError, load_config_off_loop
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.control.coordination import kubernetes_rollouts, warn_deprecated_drive
from xds_server.control.discovery.merge import Discovery
from xds_server.control.leader import LeaseElector
from xds_server.envoy.views import SnapshotViews
from xds_server.keda.scaler import ExternalScalerServicer, start_scaler_server
from xds_server.listen import listening
from xds_server.security.admin_auth import load_token
from xds_server.security.authz import NodeAuthorizer
from xds_server.security.guard import XdsGuard
from xds_server.security.limits import RateLimiter, server_options
from xds_server.security.tls import server_credentials
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.health import XDS_SERVICE_NAMES, add_health_and_reflection, set_serving
from xds_server.xds.lrs import SERVICE as LRS_SERVICE
from xds_server.xds.lrs import EnvoyLoad, LoadReportServicer
from xds_server.xds.nacks import NackLog
from xds_server.xds.protocol import StreamLimits
from xds_server.xds.server import XdsServicer, start_xds_server

log = logging.getLogger("trimtab")

SHUTDOWN_GRACE_S = 2.0


# Keys read once at start (listen addresses, TLS, server limits, the admin token, the state
# file): a reload that changes one is refused, naming it.
RESTART_ONLY = ("xds", "admin", "keda.address", "rollouts.state_file",
                "coordination")  # the Lease elector and the state store are built at start


def _leaves(value: object, path: str) -> dict[str, object]:
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for key, inner in value.items():
            out.update(_leaves(inner, f"{path}.{key}"))
        return out
    return {path: value}


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The RESTART_ONLY keys (to the leaf, e.g. ``xds.tls.cert_file``) ``new`` changes."""
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    changed: list[str] = []
    for key in RESTART_ONLY:
        section, _, leaf = key.partition(".")
        a, b = before.get(section), after.get(section)
        if leaf:
            a, b = (a or {}).get(leaf), (b or {}).get(leaf)
        if a != b:
            old_leaves, new_leaves = _leaves(a, key), _leaves(b, key)
            changed += sorted(k for k in old_leaves.keys() | new_leaves.keys()
                              if old_leaves.get(k, None) != new_leaves.get(k, None)
                              or (k in old_leaves) != (k in new_leaves))
    return changed


def _refuse(problems: list[tuple[str, str]]) -> bool:
    for path, reason in problems:
        log.error("reload refused: %s; keeping the last good config",
                  f"{path}: {reason}" if path else reason)
    return False


def state_file_path(config: Config, config_path: str | Path | None) -> Path:
    path = Path(config.rollouts.state_file)
    if not path.is_absolute() and config_path is not None:
        path = Path(config_path).resolve().parent / path
    return path


class Trimtab:
    """One control plane. `start()`, then `run(stop)` until `stop` is set."""

    def __init__(self, config: Config, config_path: str | Path | None = None,
                 controller_type: type[Controller] = Controller) -> None:
        self.config = config
        self.config_path = config_path
        self.cache = SnapshotCache()
        warn_deprecated_drive(config)
        coordinated = kubernetes_rollouts(config)  # None: embedded mode (the state file)
        self.elector: LeaseElector | None = coordinated[1] if coordinated else None
        # discovered endpoints (EndpointSlices, DNS names) reach the controller only through
        # reconcile; until then, an endpoint addressed by DNS name has no endpoint
        self.discovery = Discovery(self._apply_discovered)
        self.controller = controller_type(self.discovery.effective(config), self.cache,
                                          state_file=state_file_path(config, config_path),
                                          rollouts=coordinated[0] if coordinated else None)
        self.history = WeightHistory.for_interval(config.telemetry.interval_seconds)
        self.controller.on_tick_off_loop.append(self._prepare_history)
        self.nacks = NackLog()
        limits = config.xds.limits
        self.guard = XdsGuard(
            NodeAuthorizer.from_config(config.nodes),
            RateLimiter(limits.requests_per_second, limits.request_burst)
            if limits.requests_per_second is not None else None,
            SnapshotViews())  # from the inputs each snapshot is published with
        self.servicer = XdsServicer(self.cache, observers=[self.nacks], guard=self.guard,
                                    limits=StreamLimits(limits.max_resource_names,
                                                        limits.max_response_bytes))
        # Envoy's load reports (LRS), every tick: what each Envoy admitted and refused
        self.load = EnvoyLoad()
        self.load_reports = LoadReportServicer(
            self.cache, self.load, lambda: self.controller.config.telemetry.interval_seconds,
            guard=self.guard)
        # every Envoy receiving the admission layer holds an even part of each budget
        self.controller.envoys = lambda pool: self.servicer.subscribers(type_urls.RUNTIME)
        self._grpc: grpc.aio.Server | None = None
        self.xds_port: int | None = None
        self.scaler_port: int | None = None
        self._scaler: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._admin: web.AppRunner | None = None
        self.classifier = EmbeddedClassifier()  # runs while a pool has intent tiers

    def ready(self) -> bool:
        return self.controller.stats.ticks > 0 and self.cache.snapshot is not None

    async def start(self) -> None:
        services = [*XDS_SERVICE_NAMES, LRS_SERVICE]

        def extras(server: grpc.aio.Server) -> None:
            server.add_generic_rpc_handlers(tuple(self.load_reports.handlers()))
            self._health = add_health_and_reflection(server, services)

        await self.classifier.start(self.config)  # before Envoy can learn its cluster
        xds = self.config.xds
        credentials = (server_credentials(xds.tls.cert_file, xds.tls.key_file,
                                          xds.tls.client_ca_file, xds.tls.require_client_cert,
                                          reload=xds.tls.reload)
                       if xds.tls is not None else None)
        options = server_options(xds.limits.max_streams_per_connection,
                                 xds.limits.max_request_bytes,
                                 xds.limits.max_connection_age_seconds,
                                 xds.limits.max_connection_age_grace_seconds)
        self._grpc, self.xds_port = await listening(xds.address, lambda: start_xds_server(
            self.servicer, xds.address, configure=extras, credentials=credentials,
            options=options, maximum_concurrent_rpcs=xds.limits.max_streams))
        assert self._health is not None
        await set_serving(self._health, services, False)
        if self.config.keda.address is not None:
            scaler = ExternalScalerServicer(self.controller.autoscaler.source)
            keda = self.config.keda.address
            self._scaler, self.scaler_port = await listening(
                keda, lambda: start_scaler_server(scaler, keda))
        admin = self.config.admin.host_port
        auth = self.config.admin.auth
        api = AdminApi(self.controller, self.ready, self.servicer, self.nacks, self.history,
                       token=load_token(auth.token_file, auth.token_env),
                       protect_reads=auth.protect_reads, load=self.load)
        self._admin = await listening(self.config.admin.address,
                                      lambda: start_admin(api, admin.host, admin.port))
        self.discovery.start(self.config)
        # the first tick's snapshot holds the named endpoints that resolve within a lookup
        await self.discovery.dns_settled(self.config.discovery.dns.timeout_seconds + 0.5)
        if self.elector is not None:
            self.elector.start()
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
            await set_serving(self._health, [*XDS_SERVICE_NAMES, LRS_SERVICE], True)

    async def reload(self) -> bool:
        """Re-read the config file and apply every key, or refuse the whole reload (logged
        as ``reload refused: ...``, one line per problem) and keep the last good config: a
        bad file, or a change to a key that only takes effect at start (see RESTART_ONLY).
        The file is read and validated off the loop, bounded in time, and only if it is a
        regular file (a FIFO is refused without opening it)."""
        if self.config_path is None:
            return False
        try:
            config = await load_config_off_loop(self.config_path)
        except ConfigError as exc:
            return _refuse(exc.problems)
        except Exception as exc:  # noqa: BLE001 - SIGHUP must never kill or half-apply
            return _refuse([("", f"cannot load {self.config_path}: {type(exc).__name__}: {exc}")])
        fixed = restart_only_changes(self.config, config)
        if fixed:
            return _refuse([(key, "cannot change while running; restart trimtab to apply it")
                            for key in fixed])
        problems = await self.classifier.reload(config)  # new rules, or why not
        if problems:
            return _refuse(problems)
        try:
            await self._apply_reload(config)
        except Exception:  # noqa: BLE001 - logged with its traceback, the loop goes on
            log.exception("reload of %s failed while applying it", self.config_path)
            return False
        log.info("reloaded config from %s", self.config_path)
        return True

    async def _apply_reload(self, config: Config) -> None:
        self.config = config
        self.guard.update(NodeAuthorizer.from_config(config.nodes))
        self.history.resize(WeightHistory.for_interval(config.telemetry.interval_seconds)
                            .max_points)
        await self.discovery.close()
        await self.controller.reload(self.discovery.effective(config))
        self.discovery.start(config)

    def _prepare_history(self) -> Callable[[], None]:
        """On the telemetry worker: the history point (each endpoint's weight and staleness,
        read from what a tick replaces, never mutates); the loop then adds it. `/v1/weights`
        itself is built on the admin thread, only when read (`admin/builds.py`)."""
        point = history_point(self.controller.clock(),
                              weights_summary(self.controller.config, self.controller.weights))
        return lambda: self.history.add(point)

    def _apply_discovered(self, config: Config) -> None:
        self.controller.reconcile(config)

    async def close(self) -> None:
        if self.elector is not None:  # first: stop driving, hand the Lease to another replica
            elector, self.elector = self.elector, None
            await elector.aclose(release=True)
        await self.discovery.close()
        self.discovery.dns.close()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._scaler is not None:
            await self._scaler.stop(SHUTDOWN_GRACE_S)
            self._scaler = None
        self.servicer.close_streams()
        self.load_reports.close_streams()
        if self._grpc is not None:
            await self._grpc.stop(SHUTDOWN_GRACE_S)
            self._grpc = None
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        await self.controller.close()
        await self.classifier.close()
