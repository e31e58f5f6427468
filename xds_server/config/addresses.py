"""Addresses in a config: ``host:port`` (``[v6]:port`` for IPv6) parsed into a `HostPort`;
which IPs can be an endpoint's, and which host names are syntactically DNS names."""

from __future__ import annotations

import ipaddress
import re
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


MAX_HOSTNAME_CHARS = 253  # RFC 1035/1123: a name's text form, without a final dot
MAX_LABEL_CHARS = 63
_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?$")


def hostname_problem(host: str) -> str | None:
    """Why ``host`` is not a DNS host name (RFC 1123: dot-separated labels of 1..63 letters,
    digits and inner hyphens, 253 characters in all, one final dot allowed, the last label
    not all digits), or None when it is one. Checks the text only: nothing is resolved."""
    name = host[:-1] if host.endswith(".") else host
    if not name:
        return "an empty host name"
    if len(name) > MAX_HOSTNAME_CHARS:
        return f"a host name of {len(name)} characters (at most {MAX_HOSTNAME_CHARS})"
    labels = name.split(".")
    for label in labels:
        if len(label) > MAX_LABEL_CHARS:
            return f"a label of {len(label)} characters (at most {MAX_LABEL_CHARS})"
        if not _LABEL.match(label):
            return (f"label {label[:MAX_LABEL_CHARS]!r} is not 1..63 letters, digits and "
                    f"inner hyphens (RFC 1123)")
    if labels[-1].isdigit():
        return "not an IP address, and a host name's last label is not all digits"
    return None


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
