"""Pool endpoints discovered from Kubernetes EndpointSlices (``discovery.k8s.io/v1``).

A :class:`EndpointSliceWatcher` lists and then watches the slices labelled
``kubernetes.io/service-name=<service>`` in one namespace with the official (synchronous)
``kubernetes`` client, in a dedicated thread. The asyncio side is level-based: the watcher
publishes only the LATEST merged endpoint set (``current()``, the ``changed`` event and an
optional ``on_change`` callback), never a queue of every watch event.

resourceVersion handling: list, remember the list's resourceVersion, watch from it, and
advance it on every event (BOOKMARKs included). A 410 Gone (HTTP 410 or an ERROR event with
code 410) re-lists from scratch; any other failure (dropped connection, 5xx, timeouts) backs
off exponentially with jitter and resumes the watch from the last resourceVersion.

Health mapping (:attr:`DiscoveredEndpoint.health`), with the API's nil defaults applied first
(ready: nil = true; serving: nil = the value of ready; terminating: nil = false):

- ready and not terminating -> ``HEALTHY``;
- otherwise, serving or ready (e.g. terminating but still serving) -> ``DRAINING``:
  Envoy sends it no new requests but lets in-flight streams finish;
- not serving and not ready -> EXCLUDED from the set (``health`` is None). Like kube-proxy,
  we do not route to (or scrape) pods that are starting or gone; Envoy drains the
  connections of hosts removed from EDS gracefully.

One address per endpoint (the first: the API defines no semantics for the rest), on the port
named ``port_name`` (or the slice's only port when ``port_name`` is None). Slices without that
port and FQDN addresses are skipped. An address that can be no pod's is refused and never
enters EDS: unspecified (``0.0.0.0``, ``::``), loopback (``127.0.0.0/8``, ``::1``: trimtab's
own host, never a discovered pod), link-local (``169.254.0.0/16``, the cloud metadata
service included, ``fe80::/10``) and multicast; each is logged at warning the first time it
is seen and every refusal is counted (:class:`RefusedAddresses`). An address in several slices (e.g. while slices are
being rebalanced) appears once, with its healthiest conditions.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from xds_server.config.addresses import unroutable_reason
from xds_server.control.discovery.handover import LoopHandover
from xds_server.envoy.clusters import DRAINING, HEALTHY

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
HTTP_GONE = 410
_HEALTH_RANK = {HEALTHY: 2, DRAINING: 1, None: 0}


@dataclass(frozen=True, order=True)
class DiscoveredEndpoint:
    """One endpoint of the service. ``address`` is ``ip:port`` (``[v6]:port`` for IPv6)."""

    address: str
    ready: bool
    serving: bool
    terminating: bool
    zone: str | None = None
    node: str | None = None

    @property
    def health(self) -> str | None:
        """HEALTHY, DRAINING, or None (not routable: left out of the discovered set)."""
        if self.ready and not self.terminating:
            return HEALTHY
        if self.serving or self.ready:
            return DRAINING
        return None


EndpointSet = tuple[DiscoveredEndpoint, ...]


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: attempt n waits ``min(cap, base * 2**n)`` scaled by a
    random factor in [0.5, 1)."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rand: Callable[[], float] = random.random

    def delay(self, attempt: int) -> float:
        ceiling = min(self.cap_s, self.base_s * (2 ** min(attempt, 32)))
        return ceiling * (0.5 + 0.5 * self.rand())


MAX_LOGGED_REFUSALS = 1024  # distinct refused addresses remembered (and logged) per watcher


@dataclass
class RefusedAddresses:
    """Discovered addresses refused because they can be no pod's: ``total`` counts every
    refusal (each time a slice carrying one is read), ``addresses`` the distinct ones, each
    logged at warning the first time (the first MAX_LOGGED_REFUSALS of them)."""

    total: int = 0
    addresses: set[str] = field(default_factory=set)
    kind: str = "EndpointSlice"  # what carried them, for the log line (also "Pod")

    def refuse(self, slice_: str, address: str, reason: str) -> None:
        self.total += 1
        if address in self.addresses or len(self.addresses) >= MAX_LOGGED_REFUSALS:
            return
        self.addresses.add(address)
        log.warning("%s %r: endpoint %s refused, never sent to Envoy: %s",
                    self.kind, slice_[:253], address, reason)


# -- mapping -----------------------------------------------------------------------------------

def format_address(ip: str, port: int) -> str | None:
    """``ip:port`` or ``[v6]:port``; None for anything that is not an IP (FQDN slices)."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return None
    return f"[{parsed}]:{port}" if parsed.version == 6 else f"{parsed}:{port}"


def slice_name(slice_: Any) -> str:
    return (slice_.metadata.name if slice_.metadata else None) or ""


def select_port(slice_: Any, port_name: str | None) -> int | None:
    """The port named ``port_name``; with None, the only port. None if there is no match."""
    ports = [p for p in (slice_.ports or []) if p.port is not None]
    if port_name is None:
        return ports[0].port if len(ports) == 1 else None
    return next((p.port for p in ports if (p.name or "") == port_name), None)


def endpoints_of_slice(slice_: Any, port_name: str | None,
                       refused: RefusedAddresses | None = None) -> list[DiscoveredEndpoint]:
    """Every endpoint of one V1EndpointSlice, healthy or not, less the addresses that can be
    no pod's (counted in ``refused``, a throwaway one when None)."""
    port = select_port(slice_, port_name)
    if port is None:
        log.warning("EndpointSlice %s has no port %r; skipping it", slice_name(slice_),
                    port_name)
        return []
    refused = refused if refused is not None else RefusedAddresses()
    found = []
    for item in slice_.endpoints or []:
        address = format_address(item.addresses[0], port) if item.addresses else None
        if address is None:
            continue
        reason = unroutable_reason(item.addresses[0], allow_loopback=False)
        if reason is not None:
            refused.refuse(slice_name(slice_), address, reason)
            continue
        conditions = item.conditions
        ready = conditions is None or conditions.ready is not False
        serving = ready if conditions is None or conditions.serving is None else conditions.serving
        terminating = bool(conditions and conditions.terminating)
        found.append(DiscoveredEndpoint(address, ready, serving, terminating,
                                        item.zone, item.node_name))
    return found


def merge_endpoints(per_slice: Iterable[Iterable[DiscoveredEndpoint]]) -> EndpointSet:
    """Routable endpoints across slices, one per address (the healthiest), sorted by address."""
    best: dict[str, DiscoveredEndpoint] = {}
    for endpoints in per_slice:
        for found in endpoints:
            if found.health is None:
                continue
            held = best.get(found.address)
            if held is None or _HEALTH_RANK[found.health] > _HEALTH_RANK[held.health]:
                best[found.address] = found
    return tuple(sorted(best.values()))


# -- client construction --------------------------------------------------------------------------

def make_api_client(host: str | None = None, *, kubeconfig: str | None = None,
                    context: str | None = None) -> k8s_client.ApiClient:
    """An ApiClient for ``host`` (tests: ``http://127.0.0.1:<port>``, no auth); else the
    in-cluster service account; else the kubeconfig (``$KUBECONFIG`` / ``~/.kube/config``)."""
    configuration = k8s_client.Configuration()
    if host is not None:
        configuration.host = host
        return k8s_client.ApiClient(configuration)
    if kubeconfig is None:
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
            return k8s_client.ApiClient(configuration)
        except k8s_config.ConfigException:
            log.info("not running in a cluster; loading the kubeconfig")
    # The client reads $KUBECONFIG at import time; read it now so later changes count.
    config_file = kubeconfig or os.environ.get("KUBECONFIG")
    k8s_config.load_kube_config(config_file=config_file, context=context,
                                client_configuration=configuration)
    return k8s_client.ApiClient(configuration)


def watch_endpoint_slices(namespace: str, service: str, port_name: str | None = None, *,
                          api_client: k8s_client.ApiClient | None = None,
                          **options: Any) -> EndpointSliceWatcher:
    """A watcher (not yet started) for one service; ``api_client`` defaults to
    :func:`make_api_client` (in-cluster, then kubeconfig). ``options``: the watcher's."""
    return EndpointSliceWatcher(api_client or make_api_client(), namespace, service, port_name,
                                **options)


# -- the watcher ---------------------------------------------------------------------------------

class _Relist(Exception):
    """410 Gone: the remembered resourceVersion is too old."""


@dataclass
class EndpointSliceWatcher(LoopHandover):
    """List+watch of one service's EndpointSlices in a thread; see the module docstring.

    Call :meth:`start` from the event loop that should receive updates, then read
    :meth:`current` whenever ``changed`` is set (clear it first) or pass ``on_change``
    (called on the loop with the latest set, coalesced). :meth:`stop` ends the thread.
    """

    kind: ClassVar[str] = "EndpointSlice"
    api_client: k8s_client.ApiClient
    namespace: str
    service: str
    port_name: str | None = None
    on_change: Callable[[EndpointSet], None] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    watch_timeout_s: int = 60
    request_timeout_s: float = 30.0
    changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _current: EndpointSet = field(default=(), init=False)
    _synced: bool = field(default=False, init=False)
    _latest: EndpointSet | None = field(default=None, init=False)
    _pending: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _watch: k8s_watch.Watch = field(default_factory=k8s_watch.Watch, init=False, repr=False)
    _slices: dict[str, list[DiscoveredEndpoint]] = field(default_factory=dict, init=False)
    _published: EndpointSet | None = field(default=None, init=False)
    resource_version: str | None = field(default=None, init=False)
    list_count: int = field(default=0, init=False)
    _listed_at: float = field(default=0.0, init=False, repr=False)
    refused: RefusedAddresses = field(default_factory=RefusedAddresses, init=False)

    def __post_init__(self) -> None:
        self._api = k8s_client.DiscoveryV1Api(self.api_client)

    # -- asyncio side ------------------------------------------------------------------

    @property
    def label_selector(self) -> str:
        return f"{SERVICE_NAME_LABEL}={self.service}"

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("watcher already started")
        self._loop = loop or asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"k8s-endpointslices-{self.namespace}/{self.service}",
            daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the watch thread: interrupt the open watch (repeatedly, in case a new one was
        opening) and join. Safe to call twice or before start."""
        self._stop.set()
        thread, deadline = self._thread, time.monotonic() + timeout
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            self._watch.stop()  # unblocks a read; a watch that was just opening: next turn
            thread.join(0.05)
        if thread is not None and thread.is_alive():
            log.warning("EndpointSlice watch thread did not stop within %.1fs", timeout)
        self._thread = None

    # -- thread side -----------------------------------------------------------------------

    def _publish(self) -> None:
        merged = merge_endpoints(self._slices.values())
        if merged == self._published:
            return
        self._published = merged
        with self._lock:
            self._latest, schedule = merged, not self._pending
            self._pending = True
        if schedule and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                self._stop.set()

    def _run(self) -> None:
        attempt, need_list = 0, True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._list()
                    need_list = False
                if self._watch_once():
                    attempt = 0
                    continue
                reason = "the watch ended at once with no events"
            except _Relist:
                log.info("EndpointSlice watch for %s/%s: resourceVersion %s expired; re-listing",
                         self.namespace, self.service, self.resource_version)
                need_list = True
                if time.monotonic() - self._listed_at >= 1.0:
                    attempt = 0
                    continue  # the list was not just now: re-list at once
                reason = "410 Gone right after a list"
            except Exception as exc:  # dropped connection, 5xx, timeouts, bad payloads
                reason = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                break
            delay = self.backoff.delay(attempt)
            attempt += 1
            log.warning("EndpointSlice %s for %s/%s failed (%s); retrying in %.2fs",
                        "list" if need_list else "watch", self.namespace, self.service,
                        reason, delay)
            self._stop.wait(delay)

    def _list(self) -> None:
        listing = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self.label_selector,
            _request_timeout=self.request_timeout_s)
        self._slices = {slice_name(item): endpoints_of_slice(item, self.port_name, self.refused)
                        for item in listing.items or []}
        self.resource_version = listing.metadata.resource_version if listing.metadata else None
        self._listed_at = time.monotonic()
        self.list_count += 1
        self._publish()

    def _watch_once(self) -> bool:
        """One watch request from ``resource_version``. True if it made progress (or ended on
        the server's timeout); False if it ended at once without events. Raises _Relist."""
        started, events = time.monotonic(), 0
        stream = self._watch.stream(
            self._api.list_namespaced_endpoint_slice, self.namespace,
            label_selector=self.label_selector, resource_version=self.resource_version,
            allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
            _request_timeout=(self.request_timeout_s, self.watch_timeout_s + 30))
        try:
            for event in stream:
                if self._stop.is_set():
                    break
                self._apply(event)
                events += 1
        except ApiException as exc:
            if exc.status == HTTP_GONE:
                raise _Relist from exc
            raise
        finally:
            stream.close()  # runs the client's cleanup: closes and releases the response
        return events > 0 or time.monotonic() - started >= 1.0 or self._stop.is_set()

    def _apply(self, event: Mapping[str, Any]) -> None:
        raw = event.get("raw_object") or {}
        version = (raw.get("metadata") or {}).get("resourceVersion")
        kind, obj = event.get("type"), event.get("object")
        if kind in ("ADDED", "MODIFIED") and obj is not None:
            self._slices[slice_name(obj)] = endpoints_of_slice(obj, self.port_name, self.refused)
        elif kind == "DELETED" and obj is not None:
            self._slices.pop(slice_name(obj), None)
        if version:
            self.resource_version = version
        if kind != "BOOKMARK":
            self._publish()
