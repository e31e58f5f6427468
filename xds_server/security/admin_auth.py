"""The admin API's bearer token: read from a file or a variable (`load_token`), checked by an
aiohttp middleware in constant time (`bearer_middleware`)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_token(token_file: str | None = None, token_env: str | None = None,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The admin token from a file (first line) or an environment variable; None if neither
    is configured. Raises ValueError naming the file or variable when it is missing/empty."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"admin token file {token_file!r} cannot be read: "
                             f"{exc.strerror}") from None
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise ValueError(f"admin token file {token_file!r} is empty")
        return _ascii_token(token, f"admin token file {token_file!r}")
    if token_env is not None:
        token = (environ if environ is not None else os.environ).get(token_env, "").strip()
        if not token:
            raise ValueError(f"admin token variable {token_env} is unset or empty")
        return _ascii_token(token, f"admin token variable {token_env}")
    return None


def _ascii_token(token: str, where: str) -> str:
    """A bearer token is printable ASCII (RFC 6750 b64token): no client could send another."""
    if not (token.isascii() and token.isprintable()):
        raise ValueError(f"{where} holds characters a bearer token cannot carry (printable "
                         f"ASCII only)")
    return token


def _unauthorized(message: str) -> web.Response:
    body = {"error": {"status": 401, "message": message}}
    return web.json_response(body, status=401,
                             headers={"WWW-Authenticate": 'Bearer realm="trimtab"'})


def bearer_middleware(token: str | None, protect_reads: bool = False) -> Any:
    """aiohttp middleware: with a token, every non-GET/HEAD/OPTIONS request needs
    ``Authorization: Bearer <token>``, and reads too when `protect_reads`; /healthz and
    /readyz stay open. Comparison is constant-time. Without a token: a no-op."""
    expected = token.encode() if token else None

    @web.middleware
    async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or request.path in OPEN_PATHS:
            return await handler(request)
        if request.method in SAFE_METHODS and not protect_reads:
            return await handler(request)
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: a non-ASCII byte is a
        # lone surrogate that str.encode() refuses. A token is ASCII, so such a header is
        # simply a wrong token; only ASCII ever reaches the comparison.
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return _unauthorized("this endpoint needs 'Authorization: Bearer <token>'")
        if not given.isascii() or not hmac.compare_digest(given.encode("ascii"), expected):
            return _unauthorized("invalid bearer token")
        return await handler(request)

    return bearer
