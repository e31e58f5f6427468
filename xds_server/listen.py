"""Why a listening address cannot be bound, in one line (`trimtab serve` exits 2 with it).

grpcio reports any bind failure as ``RuntimeError: Failed to bind to address ...`` (and its C
core logs an error line of its own); aiohttp raises OSError with the errno. So, before each
server binds, `check_bindable` binds a plain socket to the same address (SO_REUSEADDR, as both
servers set; no SO_REUSEPORT, as neither does) and turns the errno into a reason; a server
that fails anyway (a race, or a reason the probe cannot see) is translated by `cannot_listen`.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

REASONS = {
    errno.EADDRINUSE: "address in use",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EADDRNOTAVAIL: "cannot assign address",
}


class CannotListen(Exception):
    """`address` cannot be listened on, for `reason` (the operator's or the host's problem)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.reason = reason


def reason_for(exc: OSError) -> str:
    """``address in use``, ``permission denied``, ``cannot assign address``; else the
    system's own words, lower-cased."""
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host ({exc.strerror or exc})"
    if exc.errno in REASONS:
        return REASONS[exc.errno]
    return (exc.strerror or str(exc)).lower()


def _split(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if host and port.isdigit() else None


def _probe(info: tuple) -> OSError | None:
    family, kind, proto, _, sockaddr = info
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
    except OSError as exc:
        return exc
    return None


def check_bindable(address: str) -> None:
    """Raise CannotListen if no address `address` (``host:port``) resolves to can be bound
    now. Port 0 (any free port) and unparseable addresses are left to the server."""
    parts = _split(address)
    if parts is None or parts[1] == 0:
        return
    try:
        infos = socket.getaddrinfo(parts[0], parts[1], type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CannotListen(address, reason_for(exc)) from None
    errors = [_probe(info) for info in infos]
    if errors and all(errors):  # grpc listens if any resolved address binds
        raise CannotListen(address, reason_for(errors[0]))  # type: ignore[arg-type]


def cannot_listen(address: str, exc: BaseException) -> CannotListen:
    """The one-line error for a server that failed to bind `address` with `exc`."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return CannotListen(address, reason_for(exc))
    try:
        check_bindable(address)
    except CannotListen as found:
        return found
    detail = " ".join(str(exc).split(";")[0].split())
    return CannotListen(address, detail or type(exc).__name__)


async def listening(address: str, start: Callable[[], Awaitable[T]]) -> T:
    """`start()` a server bound to `address`; a bind failure raises CannotListen."""
    check_bindable(address)
    try:
        return await start()
    except (OSError, RuntimeError) as exc:  # grpcio: RuntimeError; aiohttp: OSError
        raise cannot_listen(address, exc) from None
