"""Pool endpoints discovered from a Gateway API Inference Extension ``InferencePool``
(``inference.networking.k8s.io/v1``, plural ``inferencepools``).

An :class:`InferencePoolWatcher` runs two list-then-watch loops with the official (synchronous)
``kubernetes`` client, each in its own thread:

- the InferencePool itself (``CustomObjectsApi``, ``fieldSelector=metadata.name=<name>``),
  whose ``spec.selector.matchLabels`` and ``spec.targetPorts[].number`` are read;
- the Pods its selector matches (``CoreV1Api``, ``labelSelector`` built from ``matchLabels``).
  When the selector changes the pod watch is interrupted and the pods are listed again with
  the new one; a port change only recomputes the set.

Only the v1 shape is read (``spec.selector.matchLabels``, ``spec.targetPorts: [{number}]``);
the v1alpha2 group ``inference.networking.x-k8s.io`` (``spec.selector`` as a plain map,
``spec.targetPortNumber``) is not watched. A pool whose spec cannot be read (no or empty
``matchLabels``, other selector keys such as ``matchExpressions``, a label that is not a valid
Kubernetes label, more than MAX_MATCH_LABELS labels, no target port, more than
MAX_TARGET_PORTS, a port outside 1-65535) selects nothing, as a deleted or absent pool does,
and is logged at warning once per resourceVersion: the discovered set is then empty.

Each selected pod gives one endpoint per target port, ``status.podIP:port``; pods without an
IP are skipped. Health (:attr:`DiscoveredEndpoint.health`): the ``Ready`` condition ``True``
and no ``metadata.deletionTimestamp`` -> ``HEALTHY``; Ready but terminating -> ``DRAINING``
(in-flight streams finish, as an EndpointSlice's serving-but-terminating endpoint); not Ready
(or phase Succeeded/Failed) -> left out. Addresses that can be no pod's (unspecified,
loopback, link-local, multicast) are refused exactly as for EndpointSlices
(:class:`RefusedAddresses`, logged once per address, every refusal counted). At most
MAX_POOL_ENDPOINTS endpoints are published (the lowest addresses; a warning says how many were
cut).

The loops follow :mod:`~xds_server.control.discovery.kubernetes`: list, watch from the list's
resourceVersion (bookmarks advance it), 410 Gone (an HTTP 410 or an ERROR event) re-lists,
any other failure backs off exponentially with jitter and resumes from the last
resourceVersion. The asyncio side is the same level-based hand-over: ``current()``, the
``changed`` event and ``on_change`` carry only the latest set, once the pool and (when it
selects anything) its pods have been listed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubernetes import client as k8s_client
from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from xds_server.config.addresses import unroutable_reason
from xds_server.control.discovery.handover import LoopHandover
from xds_server.control.discovery.kubernetes import (
    HTTP_GONE,
    Backoff,
    DiscoveredEndpoint,
    EndpointSet,
    RefusedAddresses,
    format_address,
    make_api_client,
    merge_endpoints,
)

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
MAX_TARGET_PORTS = 8          # the v1 schema's maxItems
MAX_MATCH_LABELS = 64
MAX_POOL_ENDPOINTS = 4096     # published per pool (pods x target ports)
_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_NAME}?$")


@dataclass(frozen=True)
class PoolSpec:
    """What trimtab reads of an InferencePool: the pod label selector (as a ``labelSelector``
    query string, its terms sorted) and the target ports."""

    selector: str
    ports: tuple[int, ...]


@dataclass(frozen=True)
class PodState:
    """What an endpoint needs of one pod: its IP and conditions."""

    ip: str
    ready: bool
    terminating: bool
    node: str | None


# -- mapping -----------------------------------------------------------------------------------

def _label_problem(key: Any, value: Any) -> str | None:
    if not isinstance(key, str) or not isinstance(value, str):
        return f"label {key!r}: keys and values must be strings"
    prefix, _, name = key.rpartition("/")
    if len(prefix) > 253 or len(name) > 63 or not _LABEL_KEY.match(key):
        return f"label key {key[:80]!r} is not a valid Kubernetes label key"
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return f"label {key!r}: value {value[:80]!r} is not a valid Kubernetes label value"
    return None


def parse_pool(obj: Mapping[str, Any]) -> PoolSpec:
    """The selector and ports of a v1 InferencePool object (as JSON); ValueError says why
    it cannot be read. Labels are checked against Kubernetes' label syntax before they are
    joined into the query, so a value can never add a selector term."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping):
        raise ValueError("no spec")
    selector = spec.get("selector")
    if not isinstance(selector, Mapping):
        raise ValueError("spec.selector is missing (v1: spec.selector.matchLabels)")
    extra = sorted(str(key) for key in selector if key != "matchLabels")
    if extra:
        raise ValueError(f"spec.selector.{extra[0][:40]} is not supported; "
                         "v1 selects pods by matchLabels only")
    labels = selector.get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        raise ValueError("spec.selector.matchLabels is missing or empty (it would select "
                         "every pod in the namespace)")
    if len(labels) > MAX_MATCH_LABELS:
        raise ValueError(f"spec.selector.matchLabels has {len(labels)} labels; "
                         f"at most {MAX_MATCH_LABELS} are read")
    for key, value in labels.items():
        problem = _label_problem(key, value)
        if problem is not None:
            raise ValueError(f"spec.selector.matchLabels: {problem}")
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not raw_ports:
        raise ValueError("spec.targetPorts is missing or empty (v1: targetPorts: [{number}])")
    if len(raw_ports) > MAX_TARGET_PORTS:
        raise ValueError(f"spec.targetPorts has {len(raw_ports)} ports; "
                         f"at most {MAX_TARGET_PORTS}")
    ports: list[int] = []
    for entry in raw_ports:
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if (not isinstance(number, int) or isinstance(number, bool)
                or not 1 <= number <= 65535):
            raise ValueError(f"spec.targetPorts: {str(entry)[:80]} is not {{number: 1-65535}}")
        if number not in ports:
            ports.append(number)
    query = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
    return PoolSpec(query, tuple(ports))


def pod_state(pod: Mapping[str, Any], refused: RefusedAddresses) -> PodState | None:
    """The pod's IP and conditions; None without an IP or with one that can be no pod's
    (counted in ``refused``)."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not isinstance(ip, str) or format_address(ip, 1) is None:
        return None
    reason = unroutable_reason(ip, allow_loopback=False)
    if reason is not None:
        refused.refuse(str(metadata.get("name") or ""), ip, reason)
        return None
    ready = status.get("phase") not in ("Succeeded", "Failed") and any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or [])
    node = (pod.get("spec") or {}).get("nodeName")
    return PodState(ip, ready, metadata.get("deletionTimestamp") is not None,
                    node if isinstance(node, str) else None)


def pool_endpoints(pods: Mapping[str, PodState], ports: tuple[int, ...]) -> EndpointSet:
    """Every routable pod x target port, one per address (the healthiest), sorted; at most
    MAX_POOL_ENDPOINTS."""
    found = []
    for state in pods.values():
        for port in ports:
            address = format_address(state.ip, port)
            if address is not None:
                found.append(DiscoveredEndpoint(
                    address, ready=state.ready and not state.terminating, serving=state.ready,
                    terminating=state.terminating, node=state.node))
    merged = merge_endpoints([found])
    if len(merged) > MAX_POOL_ENDPOINTS:
        log.warning("InferencePool selects %d endpoints; the first %d are used", len(merged),
                    MAX_POOL_ENDPOINTS)
        merged = merged[:MAX_POOL_ENDPOINTS]
    return merged


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _version(obj: Mapping[str, Any]) -> str | None:
    version = (obj.get("metadata") or {}).get("resourceVersion")
    return version if isinstance(version, str) and version else None


def _json_list(call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A list request answered as plain JSON (no model classes); API errors raise."""
    response = call(*args, _preload_content=False, **kwargs)
    try:
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=response.reason)
        body = json.loads(response.data)
    finally:
        response.release_conn()
    if not isinstance(body, dict):
        raise ValueError("the list answer is not a JSON object")
    return body


def watch_inference_pool(namespace: str, name: str, *,
                         api_client: k8s_client.ApiClient | None = None,
                         **options: Any) -> InferencePoolWatcher:
    """A watcher (not yet started) for one InferencePool; ``api_client`` defaults to
    :func:`make_api_client` (in-cluster, then kubeconfig). ``options``: the watcher's."""
    return InferencePoolWatcher(api_client or make_api_client(), namespace, name, **options)


# -- the watcher ---------------------------------------------------------------------------------

class _JsonWatch(k8s_watch.Watch):  # type: ignore[misc]
    """A Watch whose events carry the objects as plain JSON (no model classes), keeping the
    client's own handling of ERROR events (which reads ``raw_object``: 410 raises
    ApiException(410))."""

    def get_return_type(self, func: Callable[..., Any]) -> None:
        return None

class _Relist(Exception):
    """410 Gone: the remembered resourceVersion is too old."""


class _Reselect(Exception):
    """The pool's selector changed: list the pods again with the new one."""


@dataclass
class InferencePoolWatcher(LoopHandover):
    """List+watch of one InferencePool and its selected pods; see the module docstring.

    Call :meth:`start` from the event loop that should receive updates, then read
    :meth:`current` whenever ``changed`` is set (clear it first) or pass ``on_change``
    (called on the loop with the latest set, coalesced). :meth:`stop` ends both threads.
    """

    kind: ClassVar[str] = "InferencePool"
    api_client: k8s_client.ApiClient
    namespace: str
    name: str
    on_change: Callable[[EndpointSet], None] | None = None
    backoff: Backoff = field(default_factory=Backoff)
    watch_timeout_s: int = 60
    request_timeout_s: float = 30.0
    changed: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    spec: PoolSpec | None = field(default=None, init=False)  # None: absent or unreadable
    pool_version: str | None = field(default=None, init=False)
    pods_version: str | None = field(default=None, init=False)
    pool_lists: int = field(default=0, init=False)
    pod_lists: int = field(default=0, init=False)
    refused: RefusedAddresses = field(default_factory=lambda: RefusedAddresses(kind="Pod"),
                                      init=False)
    _current: EndpointSet = field(default=(), init=False)
    _synced: bool = field(default=False, init=False)
    _latest: EndpointSet | None = field(default=None, init=False)
    _pending: bool = field(default=False, init=False)
    _published: EndpointSet | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _state: Any = field(default_factory=threading.RLock, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _pods_wake: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _threads: list[threading.Thread] = field(default_factory=list, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _pool_watch: k8s_watch.Watch = field(default_factory=lambda: _JsonWatch(), init=False,
                                         repr=False)
    _pod_watch: k8s_watch.Watch = field(default_factory=lambda: _JsonWatch(), init=False,
                                        repr=False)
    _pods: dict[str, PodState] = field(default_factory=dict, init=False, repr=False)
    _generation: int = field(default=0, init=False)     # bumped when the selector changes
    _pods_generation: int = field(default=-1, init=False)  # the selection the pods thread has
    _pods_listed: int = field(default=-1, init=False)   # the selection its last list was for
    _pool_listed: bool = field(default=False, init=False)
    _refused_spec: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._custom = k8s_client.CustomObjectsApi(self.api_client)
        self._core = k8s_client.CoreV1Api(self.api_client)

    # -- asyncio side ------------------------------------------------------------------

    @property
    def field_selector(self) -> str:
        return f"metadata.name={self.name}"

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._threads:
            raise RuntimeError("watcher already started")
        self._loop = loop or asyncio.get_running_loop()
        self._stop.clear()
        where = f"{self.namespace}/{self.name}"
        self._threads = [
            threading.Thread(target=self._run_pool, name=f"k8s-inferencepool-{where}",
                             daemon=True),
            threading.Thread(target=self._run_pods, name=f"k8s-inferencepool-pods-{where}",
                             daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End both threads: interrupt their open watches (repeatedly, in case a new one was
        opening) and join. Safe to call twice or before start."""
        self._stop.set()
        self._pods_wake.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < deadline:
                self._pool_watch.stop()
                self._pod_watch.stop()
                thread.join(0.05)
            if thread.is_alive():
                log.warning("InferencePool watch thread %s did not stop within %.1fs",
                            thread.name, timeout)
        self._threads = []

    # -- thread side: shared state (under _state) ------------------------------------------

    def _publish(self) -> None:
        """Hand the set over, once the pool and the pods of its current selection are listed."""
        if not self._pool_listed or self._pods_listed != self._generation:
            return
        ports = self.spec.ports if self.spec is not None else ()
        merged = pool_endpoints(self._pods, ports)
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
                self._pods_wake.set()

    def _set_pool(self, obj: Mapping[str, Any] | None, listed: bool = False) -> None:
        """The pool as now seen (None: absent); ``listed``: by a list. A new selector starts a
        new selection: the pods thread is interrupted and lists again; new ports only
        recompute the set."""
        spec: PoolSpec | None = None
        if obj is not None:
            try:
                spec = parse_pool(obj)
            except ValueError as exc:
                version = _version(obj)
                if version != self._refused_spec:
                    self._refused_spec = version
                    log.warning("InferencePool %s/%s (resourceVersion %s) selects no pods: %s",
                                self.namespace, self.name, version, exc)
        with self._state:
            old = self.spec
            self.spec = spec
            self._pool_listed = self._pool_listed or listed
            reselect = (old.selector if old else None) != (spec.selector if spec else None)
            if reselect:
                self._generation += 1
            else:
                self._publish()
        if reselect:
            self._interrupt_pods()

    def _interrupt_pods(self) -> None:
        """Make the pods thread list again for the new selection: wake it and stop its open
        watch until it has taken the new selection (bounded by the request timeout)."""
        self._pods_wake.set()
        deadline = time.monotonic() + self.request_timeout_s
        while (self._pods_generation != self._generation and not self._stop.is_set()
               and time.monotonic() < deadline):
            self._pod_watch.stop()
            self._stop.wait(0.02)

    # -- thread side: the loops ------------------------------------------------------------

    def _loop_forever(self, what: str, list_once: Callable[[], None],
                      watch_once: Callable[[], bool], sleeper: threading.Event) -> None:
        attempt, need_list, listed_at = 0, True, 0.0
        while not self._stop.is_set():
            try:
                if need_list:
                    list_once()
                    listed_at, need_list = time.monotonic(), False
                if watch_once():
                    attempt = 0
                    continue
                reason = "the watch ended at once with no events"
            except _Reselect:
                need_list, attempt = True, 0
                continue
            except _Relist:
                log.info("%s watch for %s/%s: resourceVersion expired; re-listing", what,
                         self.namespace, self.name)
                need_list = True
                if time.monotonic() - listed_at >= 1.0:
                    attempt = 0
                    continue  # the list was not just now: re-list at once
                reason = "410 Gone right after a list"
            except Exception as exc:  # dropped connection, 5xx, timeouts, bad payloads
                reason = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                break
            delay = self.backoff.delay(attempt)
            attempt += 1
            log.warning("%s %s for %s/%s failed (%s); retrying in %.2fs", what,
                        "list" if need_list else "watch", self.namespace, self.name,
                        str(reason)[:300], delay)
            sleeper.wait(delay)

    def _stream(self, watch: k8s_watch.Watch, call: Callable[..., Any], args: tuple[Any, ...],
                version: str | None, apply: Callable[[Mapping[str, Any]], None],
                **selectors: str) -> bool:
        """One watch request from ``version``. True if it made progress (or ended on the
        server's timeout); False if it ended at once without events. Raises _Relist."""
        started, events = time.monotonic(), 0
        stream = watch.stream(
            call, *args, resource_version=version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=(self.request_timeout_s, self.watch_timeout_s + 30), **selectors)
        try:
            for event in stream:
                if self._stop.is_set():
                    break
                if isinstance(event, Mapping):
                    apply(event)
                    events += 1
        except ApiException as exc:
            if exc.status == HTTP_GONE:
                raise _Relist from exc
            raise
        finally:
            stream.close()  # runs the client's cleanup: closes and releases the response
        return events > 0 or time.monotonic() - started >= 1.0 or self._stop.is_set()

    # the pool

    def _run_pool(self) -> None:
        self._loop_forever("InferencePool", self._list_pool, self._watch_pool, self._stop)

    def _list_pool(self) -> None:
        listing = _json_list(self._custom.list_namespaced_custom_object, GROUP, VERSION,
                             self.namespace, PLURAL, field_selector=self.field_selector,
                             _request_timeout=self.request_timeout_s)
        items = [i for i in listing.get("items") or [] if isinstance(i, Mapping)
                 and _name(i) == self.name]
        self.pool_version = _version(listing)
        self.pool_lists += 1
        self._set_pool(items[0] if items else None, listed=True)

    def _watch_pool(self) -> bool:
        return self._stream(self._pool_watch, self._custom.list_namespaced_custom_object,
                            (GROUP, VERSION, self.namespace, PLURAL), self.pool_version,
                            self._apply_pool, field_selector=self.field_selector)

    def _apply_pool(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            return
        if kind in ("ADDED", "MODIFIED") and _name(obj) == self.name:
            self._set_pool(obj)
        elif kind == "DELETED" and _name(obj) == self.name:
            self._set_pool(None)
        version = _version(obj)
        if version:
            self.pool_version = version

    # the pods

    def _run_pods(self) -> None:
        self._loop_forever("InferencePool pod", self._list_pods, self._watch_pods,
                           self._pods_wake)

    def _list_pods(self) -> None:
        self._pods_wake.clear()
        with self._state:
            generation, spec = self._generation, self.spec
            self._pods_generation = generation
        if spec is None:
            listed: dict[str, PodState] = {}
            self.pods_version = None
        else:
            listing = _json_list(self._core.list_namespaced_pod, self.namespace,
                                 label_selector=spec.selector,
                                 _request_timeout=self.request_timeout_s)
            listed = {}
            for item in listing.get("items") or []:
                if isinstance(item, Mapping):
                    state = pod_state(item, self.refused)
                    if state is not None:
                        listed[_name(item)] = state
            self.pods_version = _version(listing)
            self.pod_lists += 1
        with self._state:
            if generation != self._generation:
                raise _Reselect
            self._pods, self._pods_listed = listed, generation
            self._publish()

    def _watch_pods(self) -> bool:
        with self._state:
            generation, spec = self._generation, self.spec
        if generation != self._pods_generation:
            raise _Reselect
        if spec is None:  # nothing selected: wait for a selector (or the next turn)
            self._pods_wake.wait(self.watch_timeout_s)
            return True
        try:
            progressed = self._stream(self._pod_watch, self._core.list_namespaced_pod,
                                      (self.namespace,), self.pods_version, self._apply_pod,
                                      label_selector=spec.selector)
        except (_Reselect, _Relist):
            raise
        except Exception:
            if self._generation != self._pods_generation:
                raise _Reselect from None  # we cut the watch ourselves: a new selection
            raise
        if self._generation != self._pods_generation:
            raise _Reselect
        return progressed

    def _apply_pod(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, Mapping):
            return
        with self._state:
            if self._generation != self._pods_generation:
                raise _Reselect  # events of the old selection are not applied
            if kind in ("ADDED", "MODIFIED"):
                state = pod_state(obj, self.refused)
                if state is None:
                    self._pods.pop(_name(obj), None)
                else:
                    self._pods[_name(obj)] = state
            elif kind == "DELETED":
                self._pods.pop(_name(obj), None)
            version = _version(obj)
            if version:
                self.pods_version = version
            if kind != "BOOKMARK":
                self._publish()
