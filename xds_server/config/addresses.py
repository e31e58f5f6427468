"""Addresses in a config: ``host:port`` (``[v6]:port`` for IPv6) parsed into a `HostPort`."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(value: str) -> HostPort:
    """Parse ``host:port`` (``[v6]:port`` for IPv6). Raises ValueError with the reason."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected host:port, got {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port_text.isdigit():
        raise ValueError(f"expected host:port, got {value!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535, got {port} in {value!r}")
    if any(ch.isspace() for ch in host):
        raise ValueError(f"expected host:port, got {value!r}")
    return HostPort(host, port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _unwrapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address
               ) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) as the IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def unroutable_reason(host: str, *, allow_loopback: bool) -> str | None:
    """Why an endpoint IP can never be one model server's address, or None when it can.

    Refused: unspecified (``0.0.0.0``, ``::``), multicast (``224.0.0.0/4``, ``ff00::/8``),
    link-local (``169.254.0.0/16``, cloud metadata included; ``fe80::/10``) and, unless
    ``allow_loopback``, loopback (``127.0.0.0/8``, ``::1``); an IPv4-mapped IPv6 address
    counts as the IPv4 address it carries. A host that is not an IP gives None (other checks
    refuse it)."""
    try:
        ip = _unwrapped(ipaddress.ip_address(host))
    except ValueError:
        return None
    if ip.is_unspecified:
        return "an unspecified address (0.0.0.0, ::) names no host"
    if ip.is_multicast:
        return "a multicast address is not one host"
    if ip.is_link_local:
        return "a link-local address (169.254.0.0/16, fe80::/10) is not routable"
    if ip.is_loopback and not allow_loopback:
        return "a loopback address (127.0.0.0/8, ::1) is this host, not a discovered pod"
    return None


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


def _host_key(host: str) -> str:
    try:
        return str(_unwrapped(ipaddress.ip_address(host)))
    except ValueError:
        return host.lower()


def same_socket(a: HostPort, b: HostPort) -> bool:
    """True when two listeners on ``a`` and ``b`` cannot both bind: the same port (port 0, a
    port the kernel picks, never conflicts) and the same host, or either host a wildcard
    (``0.0.0.0`` or ``::``, which take the port on every address)."""
    if a.port != b.port or a.port == 0:
        return False
    hosts = {_host_key(a.host), _host_key(b.host)}
    return len(hosts) == 1 or bool(hosts & WILDCARD_HOSTS)
