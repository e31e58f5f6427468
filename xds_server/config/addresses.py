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
