"""The live status page at `/`: weights over time, signals, NACKs and rollouts.

Every asset is package data under `xds_server/admin/static/`; the page loads nothing from any other
origin (its Content-Security-Policy says so) and polls the admin JSON endpoints itself.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

from xds_server.admin.builds import AdminWorker
from xds_server.admin.encoding import DocumentLimits
from xds_server.admin.history import HistoryEncoder, WeightHistory

STATIC_PACKAGE = "xds_server.admin"
STATIC_DIR = "static"
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
# A bare file name: no separators, no leading dot, a known extension. Anything else is a 404.
ASSET_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(" + "|".join(
    re.escape(ext) for ext in CONTENT_TYPES) + r")$")
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True)
class HistoryServing:
    """What `/v1/history` reads: the history, and the admin thread that encodes it."""

    history: WeightHistory
    worker: AdminWorker
    encoder: HistoryEncoder
    limit: int


HISTORY_KEY = web.AppKey("trimtab_weight_history", HistoryServing)


def add_status_routes(app: web.Application, history: WeightHistory,
                      worker: AdminWorker | None = None,
                      limit: int = DocumentLimits.history_bytes) -> None:
    """Register `GET /` (the page), `GET /static/{name}` and `GET /v1/history` (encoded on
    ``worker``'s thread, at most ``limit`` bytes)."""
    if worker is None:
        worker = AdminWorker()
        app.on_cleanup.append(lambda _: _close(worker))
    app[HISTORY_KEY] = HistoryServing(history, worker, HistoryEncoder(), limit)
    app.router.add_get("/", _index)
    app.router.add_get("/static/{name}", _static)
    app.router.add_get("/v1/history", _history)


def read_asset(name: str) -> bytes | None:
    """An asset's bytes from package data, or None for an unknown or unsafe name."""
    if not ASSET_NAME.fullmatch(name) or ".." in name:
        return None
    asset = resources.files(STATIC_PACKAGE).joinpath(STATIC_DIR, name)
    return asset.read_bytes() if asset.is_file() else None


def _asset_response(name: str) -> web.Response:
    body = read_asset(name)
    if body is None:
        return _json_error(404, f"no such asset {name!r}")
    content_type = CONTENT_TYPES[name[name.rindex("."):]]
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers={
        "Cache-Control": "no-cache",
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
    })


async def _index(request: web.Request) -> web.Response:
    return _asset_response("index.html")


async def _static(request: web.Request) -> web.Response:
    return _asset_response(request.match_info["name"])


async def _history(request: web.Request) -> web.Response:
    raw = request.query.get("since")
    since: float | None = None
    if raw is not None:
        try:
            since = float(raw)
        except ValueError:
            since = math.nan
        if not math.isfinite(since):
            return _json_error(400, f"since: expected a number (unix seconds), got "
                                    f"{raw[:64]!r}")
    serving = request.app[HISTORY_KEY]
    span, points = serving.history.span(), serving.history.points(since)
    body = await serving.worker.run(
        "history", lambda: serving.encoder.encode(span, points, serving.limit))
    return web.Response(body=body, content_type="application/json")


async def _close(worker: AdminWorker) -> None:
    worker.close()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data, sort_keys=True), status=status,
                        content_type="application/json")


def _json_error(status: int, message: str) -> web.Response:
    """Same shape as the admin API's errors (`admin.json_error`, not imported: admin imports us)."""
    return _json({"error": {"status": status, "message": message}}, status)
