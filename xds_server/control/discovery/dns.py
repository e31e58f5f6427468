"""Endpoints addressed by DNS name (``address: vllm-1.inference.svc:8000``).

trimtab resolves the names itself, so every address a name resolves to becomes an ordinary
endpoint (``IP:port``): its own EDS endpoint with its own weight, and its own telemetry
target (its metrics page read at that IP). Envoy only ever sees IPs.

:class:`DnsResolver` keeps one :class:`NameState` per name:

* **Bounded.** One lookup per name at a time, each within ``timeout_seconds`` (queueing
  included), on the resolver's own pool of ``max_concurrent_lookups`` threads (the
  ``getaddrinfo`` that ``loop.getaddrinfo`` runs, but never on the loop's default executor:
  a lookup that hangs holds one of these threads, and while it does the name's next lookups
  fail as ``busy`` instead of starting another). At most ``max_addresses_per_name`` addresses
  per name are kept (the first, in address order, so replicas agree); the count of names is
  bounded by the config check ``discovery.dns.max_names``. Unspecified, link-local (the cloud
  metadata address included) and multicast answers are refused like a configured IP would be.
* **Cached and re-resolved on a schedule.** A name that resolved is looked up again
  ``refresh_seconds`` later; one that failed after ``min(retry_seconds, refresh_seconds)``.
* **Stale, then dropped.** A failed lookup keeps the name's last good addresses while the
  last good answer is at most ``stale_seconds`` old (``trimtab_dns_stale`` = 1, a WARNING on
  the first failure), then drops them (a WARNING): the name has no endpoint until it resolves
  again. A name that never resolved has no endpoint, with one WARNING on its first failure
  and ``trimtab_dns_addresses`` = 0. Nothing here raises into the caller.

:func:`resolved_endpoints` turns one configured endpoint into one endpoint per address
(``merge.py`` applies it to the config before ``controller.reconcile``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import Counter, Gauge

from xds_server.config.addresses import is_ip, unroutable_reason
from xds_server.config.checks import endpoint_name
from xds_server.config.pools import EndpointConfig
from xds_server.config.schema import Config, DnsDiscoveryConfig

log = logging.getLogger(__name__)

# socket.getaddrinfo's signature: (host, port, family, type, proto) -> [(family, type, proto,
# canonname, sockaddr)]; tests inject a fake.
GetAddrInfo = Callable[..., list[tuple[Any, ...]]]
Resolved = Mapping[str, tuple[str, ...]]  # name -> the IPs its endpoints use now

FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}

LOOKUPS = Counter("trimtab_dns_lookups_total",
                  "DNS lookups of endpoint host names, by result: ok, error (no usable "
                  "answer), timeout, busy (the name's previous lookup still running)",
                  ["result"])
ADDRESSES = Gauge("trimtab_dns_addresses",
                  "Addresses an endpoint host name contributes endpoints for now (0: none, "
                  "never resolved or dropped)", ["name"])
STALE = Gauge("trimtab_dns_stale",
              "1 while a name's endpoints are its last good addresses kept after failed "
              "lookups, else 0", ["name"])


def config_names(config: Config) -> set[str]:
    """Every endpoint host name of ``config`` (lower case, no final dot)."""
    return {name for pool in config.pools for ep in pool.all_endpoints()
            if (name := endpoint_name(ep.host_port.host)) is not None}


def _sort_key(ip: str) -> tuple[int, int]:
    parsed = ipaddress.ip_address(ip)
    return parsed.version, int(parsed)


def _ip_of(sockaddr: tuple[Any, ...]) -> str | None:
    text = str(sockaddr[0]).partition("%")[0]  # an IPv6 zone id is no part of the address
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


@dataclass(frozen=True)
class NameState:
    """One name: its addresses in use, when they were last good, when to look again."""

    addresses: tuple[str, ...] = ()  # sorted IPs; () never resolved, or dropped
    resolved_at: float | None = None  # the clock's time of the last good answer
    next_at: float = 0.0             # due for a lookup from then on
    failures: int = 0                # consecutive failed lookups
    error: str | None = None         # the latest failure

    @property
    def stale(self) -> bool:
        return self.failures > 0 and bool(self.addresses)


class _LookupFailed(Exception):
    def __init__(self, result: str, reason: str) -> None:
        super().__init__(reason)
        self.result = result


class DnsResolver:
    """The names' cache and schedule; see the module docstring. Use from one event loop.

    ``getaddrinfo`` (default :func:`socket.getaddrinfo`) and ``clock`` (monotonic seconds)
    are injectable for tests."""

    def __init__(self, settings: DnsDiscoveryConfig | None = None, *,
                 getaddrinfo: GetAddrInfo = socket.getaddrinfo,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings or DnsDiscoveryConfig()
        self.getaddrinfo = getaddrinfo
        self.clock = clock
        self.names: dict[str, NameState] = {}
        self._running: dict[str, concurrent.futures.Future[Any]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_size = 0

    def configure(self, settings: DnsDiscoveryConfig) -> None:
        """New settings (a reload); the cache is kept. A new thread count takes a new pool."""
        if self._pool is not None and settings.max_concurrent_lookups != self._pool_size:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.settings = settings

    def resolved(self) -> dict[str, tuple[str, ...]]:
        """Every name with addresses in use now, and those addresses."""
        return {name: state.addresses for name, state in self.names.items() if state.addresses}

    def next_due(self) -> float | None:
        return min((state.next_at for state in self.names.values()), default=None)

    async def refresh(self, names: Iterable[str]) -> bool:
        """Look up every name of ``names`` that is due, concurrently; forget the others.
        True when the addresses in use changed."""
        wanted = set(names)
        before = self.resolved()
        for gone in set(self.names) - wanted:
            del self.names[gone]
            _forget(gone)
        now = self.clock()
        due = sorted(name for name in wanted
                     if name not in self.names or self.names[name].next_at <= now)
        answers = await asyncio.gather(*(self._lookup(name) for name in due),
                                       return_exceptions=True)
        now = self.clock()
        for name, answer in zip(due, answers, strict=True):
            if isinstance(answer, BaseException):
                self._failed(name, answer, now)
            else:
                self._succeeded(name, answer, now)
        return self.resolved() != before

    async def _lookup(self, name: str) -> tuple[str, ...]:
        held = self._running.get(name)
        if held is not None and not held.done():
            raise _LookupFailed("busy", "the previous lookup is still running")
        settings = self.settings
        if self._pool is None:
            self._pool_size = settings.max_concurrent_lookups
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._pool_size, thread_name_prefix="trimtab-dns")
        future = self._pool.submit(self.getaddrinfo, name, None, FAMILIES[settings.family],
                                   socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._running[name] = future
        try:
            async with asyncio.timeout(settings.timeout_seconds):
                answer = await asyncio.wrap_future(future)
        except TimeoutError:
            future.cancel()  # still queued: never runs; running: finishes in its thread
            raise _LookupFailed("timeout", f"no answer within {settings.timeout_seconds:g}s"
                                ) from None
        except OSError as exc:  # socket.gaierror: NXDOMAIN, SERVFAIL, no network
            raise _LookupFailed("error", f"{type(exc).__name__}: {exc}") from None
        return self._usable(name, answer)

    def _usable(self, name: str, answer: list[tuple[Any, ...]]) -> tuple[str, ...]:
        found, refused = set(), []
        for entry in answer:
            ip = _ip_of(entry[4]) if len(entry) > 4 and entry[4] else None
            if ip is None:
                continue
            reason = unroutable_reason(ip, allow_loopback=True)
            if reason is not None:
                refused.append(f"{ip} ({reason})")
            else:
                found.add(ip)
        if not found:
            detail = f": refused {', '.join(refused[:4])}" if refused else ""
            raise _LookupFailed("error", f"no usable address{detail}")
        ordered = sorted(found, key=_sort_key)
        cap = self.settings.max_addresses_per_name
        if len(ordered) > cap:
            log.warning("DNS name %s resolved to %d addresses; keeping the first %d "
                        "(discovery.dns.max_addresses_per_name)", name, len(ordered), cap)
            ordered = ordered[:cap]
        return tuple(ordered)

    def _succeeded(self, name: str, addresses: tuple[str, ...], now: float) -> None:
        LOOKUPS.labels("ok").inc()
        held = self.names.get(name, NameState())
        if held.failures:
            log.info("DNS name %s resolves again: %s", name, ", ".join(addresses))
        elif held.addresses != addresses:
            log.info("DNS name %s resolves to %s", name, ", ".join(addresses))
        self.names[name] = NameState(addresses, now, now + self.settings.refresh_seconds)
        ADDRESSES.labels(name).set(len(addresses))
        STALE.labels(name).set(0)

    def _failed(self, name: str, exc: BaseException, now: float) -> None:
        result = exc.result if isinstance(exc, _LookupFailed) else "error"
        reason = str(exc) if isinstance(exc, _LookupFailed) else f"{type(exc).__name__}: {exc}"
        LOOKUPS.labels(result).inc()
        settings = self.settings
        held = self.names.get(name, NameState())
        retry = now + min(settings.retry_seconds, settings.refresh_seconds)
        state = replace(held, next_at=retry, failures=held.failures + 1, error=reason)
        if held.addresses:
            assert held.resolved_at is not None
            age = now - held.resolved_at
            if age > settings.stale_seconds:
                log.warning("DNS name %s: %s; its last good addresses (%s) are %.0fs old, "
                            "past discovery.dns.stale_seconds (%gs): its endpoints are "
                            "dropped", name, reason, ", ".join(held.addresses), age,
                            settings.stale_seconds)
                state = replace(state, addresses=())
            elif held.failures == 0:
                log.warning("DNS name %s: %s; keeping its last good addresses (%s) for up to "
                            "%gs", name, reason, ", ".join(held.addresses),
                            settings.stale_seconds)
        elif held.failures == 0 and held.resolved_at is None:
            log.warning("DNS name %s does not resolve (%s): it has no endpoint until it does",
                        name, reason)
        self.names[name] = state
        ADDRESSES.labels(name).set(len(state.addresses))
        STALE.labels(name).set(1 if state.stale else 0)

    async def run(self, names: Iterable[str], on_change: Callable[[], None],
                  first_pass: asyncio.Event | None = None) -> None:
        """Refresh ``names`` forever, calling ``on_change`` whenever the addresses in use
        change, and setting ``first_pass`` after the first round. Cancel to stop."""
        wanted = set(names)
        while True:
            try:
                if await self.refresh(wanted):
                    on_change()
            except Exception:  # noqa: BLE001 - resolution never ends the loop nor serve
                log.exception("DNS refresh failed; retrying")
            if first_pass is not None:
                first_pass.set()
            due = self.next_due()
            wait = self.settings.refresh_seconds if due is None else due - self.clock()
            await asyncio.sleep(min(max(wait, 0.05), self.settings.refresh_seconds))

    def close(self) -> None:
        """Let go of the lookup threads (a running lookup ends in its own time)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._running.clear()


def _forget(name: str) -> None:
    """A name no longer in the config has no series."""
    for gauge in (ADDRESSES, STALE):
        with contextlib.suppress(KeyError):
            gauge.remove(name)


def _url_at(url: str | None, name: str, ip: str) -> str | None:
    """``url`` with its host replaced by ``ip`` when its host is ``name``; else unchanged."""
    if url is None:
        return None
    parts = urlsplit(url)
    if (parts.hostname or "").rstrip(".").lower() != name:
        return url
    userinfo = parts.netloc.rpartition("@")[0]
    host = f"[{ip}]" if ":" in ip else ip
    netloc = (f"{userinfo}@" if userinfo else "") + host + (
        f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def resolved_endpoints(endpoint: EndpointConfig, resolved: Resolved) -> list[EndpointConfig]:
    """One endpoint per address of its name (none while the name has none); an endpoint
    addressed by IP as it is. Each copy keeps every other key; its ``metrics_url`` and
    ``dcgm_url``, when they name the endpoint's host, name the address instead (the default
    metrics URL, ``http://<address>/metrics``, follows the address anyway)."""
    host_port = endpoint.host_port
    if is_ip(host_port.host):
        return [endpoint]
    name = host_port.host.rstrip(".").lower()
    copies = []
    for ip in resolved.get(name, ()):
        address = f"[{ip}]:{host_port.port}" if ":" in ip else f"{ip}:{host_port.port}"
        copies.append(endpoint.model_copy(update={
            "address": address, "metrics_url": _url_at(endpoint.metrics_url, name, ip),
            "dcgm_url": _url_at(endpoint.dcgm_url, name, ip)}))
    return copies
