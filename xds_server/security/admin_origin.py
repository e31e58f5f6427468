"""Cross-site request refusal for the admin API: a state-changing request (any method but GET,
HEAD or OPTIONS) must be one a web page on another site cannot make a browser send.

The rule, checked by `cross_site_refusal` and enforced by `same_origin_middleware`, token or not:

* `Origin`, when present, names this server: its host and port equal the `Host` header's
  (an opaque `null` origin, another scheme than http/https, or two `Origin` headers are refused);
* `Sec-Fetch-Site`, when present, is `same-origin` or `none` (`same-site` is refused too: another
  port on the same host is the same site);
* `Content-Type` is `application/json` (parameters such as `charset` allowed). A browser sends
  that type to another origin only after a CORS preflight, which the admin API never answers, so
  an HTML form, `fetch(..., {mode: "no-cors"})` or `navigator.sendBeacon` cannot carry it.

Anything else is a 403 whose JSON error names the header and why. The `trimtab rollout` CLI and
the status page's buttons send `Content-Type: application/json` and no foreign `Origin`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from xds_server.security.admin_auth import SAFE_METHODS

log = logging.getLogger("trimtab.admin")

REQUIRED_CONTENT_TYPE = "application/json"
ALLOWED_FETCH_SITES = frozenset({"same-origin", "none"})
DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_QUOTED_CHARS = 100  # of a peer's header value quoted in an error or a log line
LOG_EVERY_SECONDS = 60.0  # at most one log line per this long, with the count refused
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Refusal:
    """Why a state-changing request was refused: the header at fault and a message for the peer."""

    header: str
    message: str


def quoted(value: str) -> str:
    """A peer's string for an error or a log line: at most `MAX_QUOTED_CHARS` characters, with
    quotes, control characters and undecodable bytes escaped (`repr`)."""
    if len(value) <= MAX_QUOTED_CHARS:
        return repr(value)
    return f"{value[:MAX_QUOTED_CHARS]!r}... ({len(value)} chars)"


def _authority(scheme: str, netloc: str) -> tuple[str, int] | None:
    """(lowercase host, port) of `netloc`, the port defaulting to the scheme's; None when the
    netloc does not parse as host[:port]."""
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.username is not None or parts.path or parts.query:
        return None
    return parts.hostname.lower(), port if port is not None else DEFAULT_PORTS[scheme]


def origin_refusal(origins: list[str], host: str | None) -> Refusal | None:
    """A refusal when the `Origin` header(s) name another origin than this server's, whose
    `Host` header is `host`. The scheme is not compared: no other server can hold the same host
    and port, and a TLS-terminating proxy in front changes it."""
    if not origins:
        return None
    if len(origins) > 1:
        return Refusal("Origin", f"cross-site request refused: {len(origins)} Origin headers "
                                 f"(a browser sends one)")
    origin = origins[0]
    if host is None:
        return Refusal("Origin", f"cross-site request refused: Origin {quoted(origin)} and no "
                                 f"Host header to compare it with")
    own = f"this admin server's (Host {quoted(host)})"
    try:
        parts = urlsplit(origin)
    except ValueError:
        parts = None
    if (parts is None or parts.scheme not in DEFAULT_PORTS
            or parts.path or parts.query or parts.fragment):
        return Refusal("Origin", f"cross-site request refused: Origin {quoted(origin)} is not "
                                 f"{own}")
    theirs = _authority(parts.scheme, parts.netloc)
    if theirs is None or theirs != _authority(parts.scheme, host):
        return Refusal("Origin", f"cross-site request refused: Origin {quoted(origin)} is not "
                                 f"{own}")
    return None


def fetch_site_refusal(value: str | None) -> Refusal | None:
    """A refusal when `Sec-Fetch-Site` is present and neither `same-origin` nor `none`."""
    if value is None or value.strip().lower() in ALLOWED_FETCH_SITES:
        return None
    return Refusal("Sec-Fetch-Site", f"cross-site request refused: Sec-Fetch-Site is "
                                     f"{quoted(value)}; only same-origin or none may change state")


def content_type_refusal(value: str | None) -> Refusal | None:
    """A refusal unless the `Content-Type` media type is `application/json`."""
    media_type = (value or "").partition(";")[0].strip().lower()
    if media_type == REQUIRED_CONTENT_TYPE:
        return None
    got = "none" if value is None else quoted(value)
    return Refusal("Content-Type", f"this request needs 'Content-Type: {REQUIRED_CONTENT_TYPE}' "
                                   f"(got {got}): an admin request that changes state must be "
                                   f"one a web page on another site cannot send; use `trimtab "
                                   f"rollout` or curl -H 'Content-Type: application/json'")


def cross_site_refusal(method: str, headers: Mapping[str, str],
                       origins: list[str]) -> Refusal | None:
    """Why a request with this method and these headers may not change state (None: it may).
    `origins` is every `Origin` header (a mapping's `get` gives only the first)."""
    if method.upper() in SAFE_METHODS:
        return None
    return (origin_refusal(origins, headers.get("Host"))
            or fetch_site_refusal(headers.get("Sec-Fetch-Site"))
            or content_type_refusal(headers.get("Content-Type")))


@dataclass
class RefusalLog:
    """Logs refused requests at most once per `every` seconds (a page can send them in a loop),
    saying how many were refused since the last line."""

    every: float = LOG_EVERY_SECONDS
    clock: Callable[[], float] = time.monotonic
    refused: int = 0
    last_logged: float | None = None

    def note(self, request: web.Request, refusal: Refusal) -> None:
        self.refused += 1
        now = self.clock()
        if self.last_logged is not None and now - self.last_logged < self.every:
            return
        log.warning("refused %d cross-site admin request(s) since the last such line; latest: "
                    "%s %s from %s: %s", self.refused, request.method, quoted(request.path),
                    request.remote, refusal.message)
        self.refused, self.last_logged = 0, now


def _forbidden(refusal: Refusal) -> web.Response:
    body = {"error": {"status": 403, "message": refusal.message, "header": refusal.header}}
    return web.json_response(body, status=403)


def same_origin_middleware(refusals: RefusalLog | None = None) -> Any:
    """aiohttp middleware: a state-changing request that `cross_site_refusal` refuses gets a
    JSON 403 and never reaches the handler. It runs after the bearer check, so a request
    without a valid token still gets 401."""
    refusal_log = refusals if refusals is not None else RefusalLog()

    @web.middleware
    async def same_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = cross_site_refusal(request.method, request.headers,
                                     request.headers.getall("Origin", []))
        if refusal is None:
            return await handler(request)
        refusal_log.note(request, refusal)
        return _forbidden(refusal)

    return same_origin
