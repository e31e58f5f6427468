"""Admin HTTP API (aiohttp): health, readiness, metrics and the weights trimtab holds.

Loopback by default. Errors are JSON with a proper status code. The documents that grow with
the fleet (`/v1/weights`, `/v1/snapshot`, `/v1/nacks`, `/v1/config`, `/v1/history`,
`/v1/admission`) are built
and encoded on the admin thread (`admin/builds.py`), once per version of their inputs, and
are bounded in bytes (:class:`~xds_server.admin.encoding.DocumentLimits`); connections are
bounded by `admin/serving.py`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from xds_server.admin import metrics
from xds_server.admin.builds import AdminWorker, BuildCache
from xds_server.admin.documents import (
    encode_admission,
    encode_config,
    encode_nacks,
    encode_snapshot,
    encode_weights,
    stream_rows,
)
from xds_server.admin.encoding import DocumentLimits, Encoded, TooLarge, bounded, dumps
from xds_server.admin.history import WeightHistory
from xds_server.admin.serving import ConnectionLimits, start_guarded
from xds_server.admin.status_page import add_status_routes
from xds_server.control.controller import Controller
from xds_server.control.rollouts.machine import RolloutCommandError
from xds_server.control.rollouts.runner import RolloutPersistError
from xds_server.control.rollouts.state import StateStoreError
from xds_server.security.admin_auth import bearer_middleware
from xds_server.security.admin_origin import same_origin_middleware
from xds_server.xds.lrs import STALE_INTERVALS, EnvoyLoad, LoadCollector
from xds_server.xds.nacks import NackLog
from xds_server.xds.server import XdsServicer

log = logging.getLogger("trimtab.admin")

ROLLOUT_ACTIONS = ("pause", "resume", "promote", "abort")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, indent=1, sort_keys=True), status=status,
                        content_type="application/json")


def json_error(status: int, message: str) -> web.Response:
    return _json({"error": {"status": status, "message": message}}, status)


def _encoded(encoded: Encoded) -> web.Response:
    if isinstance(encoded, TooLarge):
        return json_error(413, encoded.message)
    return web.Response(body=encoded, content_type="application/json")


def _quoted(value: str, limit: int = 64) -> str:
    """A caller's query value for an error message: repr'd and cut to ``limit`` characters."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        return json_error(exc.status, exc.reason)
    except Exception:  # noqa: BLE001 - report, never crash the admin server
        log.exception("admin request %s failed", request.path)
        return json_error(500, "internal error; see the trimtab log")


class AdminApi:
    def __init__(self, controller: Controller, is_ready: Callable[[], bool],
                 servicer: XdsServicer | None = None, nacks: NackLog | None = None,
                 history: WeightHistory | None = None, token: str | None = None,
                 protect_reads: bool = False, limits: DocumentLimits | None = None,
                 load: EnvoyLoad | None = None) -> None:
        self.controller = controller
        self._fleet = metrics.FleetCollector(lambda: self.controller.weights)
        self.load = load if load is not None else EnvoyLoad()  # Envoy's load reports (LRS)
        self._load_metrics = LoadCollector(self.load, self._stale_after_s)
        self.token = token
        self.protect_reads = protect_reads
        self.is_ready = is_ready
        self.servicer = servicer
        self.nacks = nacks
        self.history = history if history is not None else WeightHistory()
        self.limits = limits if limits is not None else DocumentLimits()
        self.worker = AdminWorker()
        self._builds: BuildCache[Encoded] = BuildCache(self.worker)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[bearer_middleware(self.token, self.protect_reads),
                                           same_origin_middleware(), _errors])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/weights", self.weights)
        app.router.add_get("/v1/snapshot", self.snapshot)
        app.router.add_get("/v1/nacks", self.nack_list)
        app.router.add_get("/v1/config", self.effective_config)
        app.router.add_get("/v1/rollouts", self.rollout_list)
        app.router.add_get("/v1/admission", self.admission)
        app.router.add_post("/v1/rollouts/{pool}/{action}", self.rollout_command)
        add_status_routes(app, self.history, self.worker, self.limits.history_bytes)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        self.worker.close()

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.is_ready()
        return _json({"ready": ready, "ticks": self.controller.stats.ticks,
                      "snapshot": getattr(self.controller.cache.snapshot, "version", None),
                      "leader": self.controller.rollouts.leader_document()},
                     200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(self._fleet, self._load_metrics),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def weights(self, request: web.Request) -> web.Response:
        """Every pool's weights, or one pool's with ``?pool=NAME``."""
        config, weights = self.controller.config, self.controller.weights
        pool = request.query.get("pool")
        names = {p.name for p in config.pools}
        if pool is not None and pool not in names:
            return json_error(404, f"pool: no pool {_quoted(pool)} in the config")
        self._builds.forget(lambda slot: slot[1] is None or slot[1] in names)
        limit = self.limits.weights_bytes

        async def job() -> Callable[[], Encoded]:
            return lambda: encode_weights(config, weights, pool, limit)
        return _encoded(await self._builds.get(("weights", pool), (config, weights), job))

    async def snapshot(self, request: web.Request) -> web.Response:
        """Each connected stream (only one node's with ``?node=ID``) and the current snapshot."""
        node = request.query.get("node")
        servicer, cache, limit = self.servicer, self.controller.cache, self.limits.snapshot_bytes

        async def job() -> Callable[[], Encoded]:
            rows, current = await stream_rows(servicer, node), cache.snapshot
            return lambda: encode_snapshot(rows, current, limit)
        # joins a build already running for the same node (an unversioned slot is dropped
        # once built, so callers' node strings do not pile up); each build copies anew
        return _encoded(await self._builds.get(("snapshot", node), None, job))

    async def nack_list(self, request: web.Request) -> web.Response:
        total = self.nacks.total if self.nacks else 0
        recent = self.nacks.recent() if self.nacks else []
        limit = self.limits.nacks_bytes

        async def job() -> Callable[[], Encoded]:
            return lambda: encode_nacks(total, recent, limit)
        return _encoded(await self._builds.get(("nacks", None), None, job))

    async def effective_config(self, request: web.Request) -> web.Response:
        config, limit = self.controller.config, self.limits.config_bytes

        async def job() -> Callable[[], Encoded]:
            return lambda: encode_config(config, limit)
        return _encoded(await self._builds.get(("config", None), (config,), job))

    def _stale_after_s(self) -> float:
        """An Envoy's latest load report counts in levels and rates for this long."""
        return STALE_INTERVALS * self.controller.config.telemetry.interval_seconds

    async def admission(self, request: web.Request) -> web.Response:
        """Every pool's budget in force and what the Envoys' load reports count."""
        config, state, limit = (self.controller.config, self.controller.admission,
                                self.limits.admission_bytes)

        async def job() -> Callable[[], Encoded]:
            load = self.load.view(self._stale_after_s())  # on the loop: the streams change
            return lambda: encode_admission(config, state, load, limit)
        return _encoded(await self._builds.get(("admission", None), None, job))

    async def rollout_list(self, request: web.Request) -> web.Response:
        """Small (a few lines per pool with versions): built on the loop, bounded all the same."""
        body = dumps({"rollouts": self.controller.rollouts.document(),
                      "leader": self.controller.rollouts.leader_document()})
        return _encoded(bounded("/v1/rollouts", body, self.limits.rollouts_bytes,
                                "each rollout's state is in rollouts.state_file (or its ConfigMap)"))

    async def rollout_command(self, request: web.Request) -> web.Response:
        pool, action = request.match_info["pool"], request.match_info["action"]
        if pool not in self.controller.rollouts.pools:
            return json_error(404, f"no rollout for pool {pool!r} (a pool needs `versions`)")
        if not self.controller.rollouts.drive:
            return json_error(409, self.controller.rollouts.refusal())
        try:
            state = await self.controller.rollouts.acommand(pool, action,
                                                            self.controller.clock())
        except RolloutCommandError as exc:
            return json_error(409 if action in ROLLOUT_ACTIONS else 400, str(exc))
        except RolloutPersistError as exc:  # ours/the environment's: nothing was changed
            log.error("rollout command %s %s refused: %s", action, pool, exc)
            return json_error(500, f"{exc}; the command was not applied")
        except StateStoreError as exc:  # the API server's or the disk's: nothing changed
            log.error("rollout command %s %s not applied: %s", action, pool, exc)
            return json_error(503, f"{exc}; the command was not applied")
        self.controller.reconcile()
        return _json({"rollouts": {pool: self.controller.rollouts.document()[pool]},
                      "phase": state.phase, "percent": state.percent})


class _ClientErrorsInOneLine(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad header byte, a duplicate Host) at ERROR
    with a traceback, per request: the client's fault, so one INFO line without one."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "bad HTTP request from %s: %s", (
                record.args[0] if isinstance(record.args, tuple) and record.args else "?",
                " ".join(str(exc.message).split())[:200])
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


HTTP_LOG = logging.getLogger("trimtab.admin.http")
HTTP_LOG.addFilter(_ClientErrorsInOneLine())


async def start_admin(api: AdminApi, host: str, port: int,
                      limits: ConnectionLimits | None = None) -> web.AppRunner:
    """Serve ``api`` on ``host:port`` (never shared with another socket), its connections
    bounded by ``limits`` (`admin/serving.py`)."""
    return await start_guarded(api.app(), host, port,
                               limits if limits is not None else ConnectionLimits(), HTTP_LOG)
