"""A small in-process fake Kubernetes API server for list+watch of EndpointSlices, Pods and
Gateway API Inference Extension InferencePools.

It speaks the real wire shapes of ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices``,
``GET /api/v1/namespaces/{ns}/pods`` and the custom-object collection
``GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools`` (:data:`WATCHED`):
a list returns an ``EndpointSliceList`` / ``PodList`` / ``InferencePoolList``, filtered by
``labelSelector`` (equality terms) and ``fieldSelector`` (``metadata.name`` and
``metadata.namespace``); ``?watch=true`` streams newline-delimited JSON events
(``ADDED|MODIFIED|DELETED|BOOKMARK|ERROR``) with chunked transfer, replaying the history after
the requested ``resourceVersion``. One resourceVersion counter serves every resource, as etcd's
does. Runs in a background thread with its own asyncio loop; every control method is
thread-safe (it runs on that loop). Test knobs:

- :meth:`FakeKube.apply` / :meth:`FakeKube.delete` change objects at run time (the resource is
  the object's ``kind``); ``apply`` of an object carrying ``metadata.resourceVersion`` is a
  replace with that precondition, refused with :class:`Conflict` (nothing stored, no event)
  when another write came first;
- :meth:`FakeKube.bookmark` bumps the resourceVersion and sends a BOOKMARK (to every watch);
- :meth:`FakeKube.compact` makes older resourceVersions "too old" (410 Gone, as an HTTP 410
  Status response or as an ERROR event in a 200 stream);
- :meth:`FakeKube.expire_watches` sends an ERROR 410 event to open watches;
- :meth:`FakeKube.drop_watches` cuts open watch connections mid-stream;
- :meth:`FakeKube.fail_next` answers the next requests with an HTTP error Status
  (:meth:`FakeKube.clear_failures` cancels the rest);
- :attr:`FakeKube.requests` records every list/watch request and the resourceVersion it asked for.

It also serves get/create/replace of single objects, as the API server does for
``coordination.k8s.io/v1`` Leases (``/apis/coordination.k8s.io/v1/namespaces/{ns}/leases``) and
``v1`` ConfigMaps (``/api/v1/namespaces/{ns}/configmaps``): every write gets a new
resourceVersion from the same counter; a create of an existing name is 409 ``AlreadyExists``,
a replace whose ``metadata.resourceVersion`` is not the stored one is 409 ``Conflict`` (the
API's Status bodies), a missing object 404 ``NotFound``; Lease times must be RFC 3339
MicroTimes. Knobs: :meth:`FakeKube.fail_objects` (an HTTP error Status, e.g. 409, 410, 500, for
the next requests of one operation), :meth:`FakeKube.delay_objects` (hold the next answers:
client timeouts), :meth:`FakeKube.modify` (a concurrent writer, e.g. between a client's read
and its replace via :meth:`FakeKube.modify_before`), and :meth:`FakeKube.add_port` /
:meth:`FakeKube.partition` (extra listening ports; requests on a partitioned one are held
unanswered until the client gives up, like a black-holed link).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

API_VERSION = "discovery.k8s.io/v1"
SERVICE_LABEL = "kubernetes.io/service-name"
INFERENCE_API_VERSION = "inference.networking.k8s.io/v1"
GoneForm = Literal["http", "event"]
_POLL_S = 0.05  # how often an idle watch checks for a departed client
_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
# watchable resource -> (collection path, apiVersion, kind)
WATCHED = {
    "endpointslices": (_PATH, API_VERSION, "EndpointSlice"),
    "pods": ("/api/v1/namespaces/{namespace}/pods", "v1", "Pod"),
    "inferencepools": ("/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
                       INFERENCE_API_VERSION, "InferencePool"),
}
_RESOURCE_OF_KIND = {kind: resource for resource, (_p, _v, kind) in WATCHED.items()}
# resource -> (collection path, apiVersion, kind, group for Status details)
OBJECT_RESOURCES = {
    "leases": ("/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
               "coordination.k8s.io/v1", "Lease", "coordination.k8s.io"),
    "configmaps": ("/api/v1/namespaces/{namespace}/configmaps", "v1", "ConfigMap", ""),
}
ObjectOp = Literal["get", "create", "replace"]
_MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)$")
CONFIGMAP_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class ObjectRecord:
    """One get/create/replace of a Lease or ConfigMap as the fake saw it."""

    resource: str
    op: str
    namespace: str
    name: str
    resource_version: str | None  # the one the client sent (replace), else None
    port: int
    status: int = 0  # what the fake answered (0 while held / never answered)


class Conflict(Exception):
    """An :meth:`FakeKube.apply` whose ``metadata.resourceVersion`` precondition failed: the
    409 ``Conflict`` the API server answers such a replace (nothing was stored)."""

    def __init__(self, status: dict[str, Any]) -> None:
        super().__init__(status["message"])
        self.status = status


@dataclass(frozen=True)
class RequestRecord:
    """One list or watch request as the fake saw it."""

    kind: Literal["list", "watch"]
    namespace: str
    label_selector: str | None
    resource_version: str | None
    allow_bookmarks: bool
    timeout_seconds: int | None
    resource: str = "endpointslices"
    field_selector: str | None = None


@dataclass
class _Event:
    rv: int
    type: str
    namespace: str | None  # None: a BOOKMARK, for every watcher
    obj: dict[str, Any]
    resource: str | None = None  # None: a BOOKMARK
    previous: dict[str, Any] | None = None  # MODIFIED: the object it replaced


@dataclass(eq=False)
class _Watcher:
    namespace: str
    selector: dict[str, str]
    bookmarks: bool
    cursor: int
    command: Literal["", "expire", "drop"] = ""
    resource: str = "endpointslices"
    fields: dict[str, str] = field(default_factory=dict)


def endpoint_slice(name: str, service: str, endpoints: list[dict[str, Any]],
                   ports: list[dict[str, Any]] | None = None, *, namespace: str = "default",
                   address_type: str = "IPv4") -> dict[str, Any]:
    """An EndpointSlice object as the API serves it (the fake fills in resourceVersion)."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": API_VERSION,
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {SERVICE_LABEL: service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports if ports is not None else [{"name": "http", "port": 8000,
                                                    "protocol": "TCP"}],
    }


def endpoint(address: str, *, ready: bool | None = True, serving: bool | None = None,
             terminating: bool | None = None, zone: str | None = None,
             node: str | None = None) -> dict[str, Any]:
    """One ``endpoints[]`` entry; a None condition is left out (the API's nil)."""
    conditions = {key: value for key, value in
                  (("ready", ready), ("serving", serving), ("terminating", terminating))
                  if value is not None}
    entry: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if zone is not None:
        entry["zone"] = zone
    if node is not None:
        entry["nodeName"] = node
    return entry


def pod(name: str, ip: str | None, labels: dict[str, str], *, ready: bool | None = True,
        phase: str = "Running", deleting: bool = False, node: str = "node-1",
        namespace: str = "default") -> dict[str, Any]:
    """A Pod as the API serves it (the fields discovery reads, and the usual others).
    ``ready`` None leaves the Ready condition out (a pod not yet scheduled); ``deleting`` sets
    ``metadata.deletionTimestamp`` (terminating); ``ip`` None: no IP assigned yet."""
    conditions = [{"type": "PodScheduled", "status": "True",
                   "lastTransitionTime": "2025-01-01T00:00:00Z"}]
    if ready is not None:
        for kind in ("Initialized", "ContainersReady", "Ready"):
            conditions.append({"type": kind, "status": "True" if ready or kind == "Initialized"
                               else "False", "lastTransitionTime": "2025-01-01T00:00:00Z"})
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels),
                                "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{namespace}/{name}")),
                                "creationTimestamp": "2025-01-01T00:00:00Z"}
    if deleting:
        metadata["deletionTimestamp"] = "2025-01-01T00:10:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    status: dict[str, Any] = {"phase": phase, "conditions": conditions,
                              "hostIP": "192.0.2.10", "qosClass": "Burstable"}
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {"kind": "Pod", "apiVersion": "v1", "metadata": metadata,
            "spec": {"nodeName": node, "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:latest",
                 "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}]}]},
            "status": status}


def inference_pool(name: str, match_labels: dict[str, str], target_ports: list[int], *,
                   namespace: str = "default", epp: str = "vllm-epp",
                   spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """An ``inference.networking.k8s.io/v1`` InferencePool as the API serves it: ``spec.selector
    .matchLabels``, ``spec.targetPorts[].number`` and the required ``endpointPickerRef``;
    ``spec`` replaces the whole spec (shapes the v1 schema would refuse, for tests)."""
    return {"kind": "InferencePool", "apiVersion": INFERENCE_API_VERSION,
            "metadata": {"name": name, "namespace": namespace, "generation": 1},
            "spec": spec if spec is not None else {
                "selector": {"matchLabels": dict(match_labels)},
                "targetPorts": [{"number": number} for number in target_ports],
                "endpointPickerRef": {"name": epp, "port": {"number": 9002},
                                      "failureMode": "FailClose"}}}


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _parse_selector(text: str | None) -> dict[str, str]:
    selector: dict[str, str] = {}
    for term in filter(None, (text or "").split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        selector[key.strip()] = value.strip()
    return selector


def _matches(obj: dict[str, Any], selector: dict[str, str],
             fields: dict[str, str] | None = None) -> bool:
    metadata = obj.get("metadata", {})
    labels = metadata.get("labels") or {}
    return (all(labels.get(key) == value for key, value in selector.items())
            and all(metadata.get(key.removeprefix("metadata.")) == value
                    for key, value in (fields or {}).items()))


def _as_seen(event: _Event, watcher: _Watcher) -> str | None:
    """The event type a watch with selectors sees, as the API server's watch cache filters:
    a MODIFIED object that stops matching is DELETED for it, one that starts matching ADDED."""
    now = _matches(event.obj, watcher.selector, watcher.fields)
    if event.type != "MODIFIED" or event.previous is None:
        return event.type if now else None
    before = _matches(event.previous, watcher.selector, watcher.fields)
    if now:
        return "MODIFIED" if before else "ADDED"
    return "DELETED" if before else None


def _line(event_type: str, obj: dict[str, Any]) -> bytes:
    return (json.dumps({"type": event_type, "object": obj}) + "\n").encode()


@dataclass
class FakeKube:
    """The fake API server. ``host`` is ``http://127.0.0.1:<free port>`` once started."""

    requests: list[RequestRecord] = field(default_factory=list, init=False)
    port: int = field(default=0, init=False)
    gone_form: GoneForm = field(default="http", init=False)
    _rv: int = field(default=100, init=False)
    _compacted_rv: int = field(default=0, init=False)
    _stored: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict,
                                                                init=False)  # (resource, ns, name)
    _history: list[_Event] = field(default_factory=list, init=False)
    _watchers: set[_Watcher] = field(default_factory=set, init=False)
    _failures: list[tuple[str, int, str | None]] = field(default_factory=list, init=False)
    _changed: asyncio.Event | None = field(default=None, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _runner: web.AppRunner | None = field(default=None, init=False, repr=False)
    _stopping: bool = field(default=False, init=False)
    object_requests: list[ObjectRecord] = field(default_factory=list, init=False)
    _objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict,
                                                                 init=False)
    _object_failures: list[tuple[str, str, int]] = field(default_factory=list, init=False)
    _object_delays: list[tuple[str, str, float]] = field(default_factory=list, init=False)
    _before: list[tuple[str, str, Callable[[dict[str, Any]], None]]] = field(
        default_factory=list, init=False)
    _partitioned: set[int] = field(default_factory=set, init=False)
    _sites: list[web.TCPSite] = field(default_factory=list, init=False)

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def host_on(self, port: int) -> str:
        return f"http://127.0.0.1:{port}"

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 10.0) -> FakeKube:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-kube",
                                        daemon=True)
        self._thread.start()
        self._call(self._start(), timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        try:
            self._call(self._stop(), timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._loop.close()
            self._thread, self._loop = None, None

    def __enter__(self) -> FakeKube:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        assert self._loop is not None, "FakeKube not started"
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        app = web.Application()
        for resource, (path, *_rest) in WATCHED.items():
            app.router.add_get(path, self._list_watch_handler(resource))
        for resource, (path, *_rest) in OBJECT_RESOURCES.items():
            collection = path
            app.router.add_post(collection, self._object_handler(resource, "create"))
            app.router.add_get(collection + "/{name}", self._object_handler(resource, "get"))
            app.router.add_put(collection + "/{name}", self._object_handler(resource, "replace"))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _stop(self) -> None:
        self._stopping = True
        self._notify()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- controls (thread-safe) ----------------------------------------------

    def apply(self, obj: dict[str, Any]) -> str:
        """Create or replace an object of a :data:`WATCHED` kind (``kind`` absent: an
        EndpointSlice) — ADDED or MODIFIED; returns its new resourceVersion. With
        ``metadata.resourceVersion`` set it is a replace on that precondition: raises
        :class:`Conflict` if the stored object has another (or none)."""
        return self._call(self._mutate(obj, deleted=False))

    def delete(self, name: str, namespace: str = "default", kind: str = "EndpointSlice") -> str:
        obj = {"kind": kind, "metadata": {"name": name, "namespace": namespace}}
        return self._call(self._mutate(obj, deleted=True))

    def bookmark(self) -> str:
        """Advance the resourceVersion (as other objects would) and send a BOOKMARK."""
        return self._call(self._bookmark())

    def compact(self, form: GoneForm = "http") -> None:
        """Every resourceVersion before the current one is now too old: watching from one is
        answered 410 Gone, as an HTTP 410 Status (``http``) or an ERROR event (``event``)."""
        self._call(self._compact(form))

    def expire_watches(self) -> None:
        """Open watches get an ERROR event ``{"kind": "Status", "code": 410}`` and end."""
        self._call(self._command("expire"))

    def drop_watches(self) -> None:
        """Open watch connections are cut mid-stream (no terminating chunk)."""
        self._call(self._command("drop"))

    def fail_next(self, kind: Literal["list", "watch"], status: int = 500, count: int = 1,
                  resource: str | None = None) -> None:
        """The next ``count`` requests of ``kind`` (on ``resource``; None: on any) are
        answered with an HTTP error Status."""
        self._call(self._add_failures([(kind, status, resource)] * count))

    def clear_failures(self) -> None:
        self._call(self._clear_failures())

    # -- Leases and ConfigMaps (thread-safe) --------------------------------------

    def get_object(self, resource: str, name: str, namespace: str = "default"
                   ) -> dict[str, Any] | None:
        """A deep copy of the stored object, or None."""
        return self._call(self._get_object(resource, namespace, name))

    def modify(self, resource: str, name: str, change: Callable[[dict[str, Any]], None],
               namespace: str = "default") -> str:
        """A concurrent writer: ``change`` edits the stored object in place; it gets a new
        resourceVersion (returned)."""
        return self._call(self._modify(resource, namespace, name, change))

    def modify_before(self, resource: str, op: ObjectOp,
                      change: Callable[[dict[str, Any]], None]) -> None:
        """Run :meth:`modify` on the target object just before the next ``op`` is served:
        a write that lands between a client's read and its replace."""
        self._call(self._add(self._before, (resource, op, change)))

    def fail_objects(self, resource: str, op: ObjectOp, status: int = 500,
                     count: int = 1) -> None:
        """The next ``count`` ``op`` requests on ``resource`` get an HTTP error Status."""
        self._call(self._add(self._object_failures, *[(resource, op, status)] * count))

    def delay_objects(self, resource: str, op: ObjectOp, seconds: float, count: int = 1) -> None:
        """Hold the next ``count`` answers for ``seconds`` (a client with a shorter timeout
        gives up; the operation is then not carried out)."""
        self._call(self._add(self._object_delays, *[(resource, op, seconds)] * count))

    def add_port(self) -> int:
        """Another listening port onto the same API server (one per client to partition)."""
        return self._call(self._add_site())

    def partition(self, port: int, cut: bool = True) -> None:
        """While cut, requests arriving on ``port`` are held unanswered (a black hole)."""
        self._call(self._set_partition(port, cut))

    def object_records(self, resource: str | None = None, op: str | None = None
                       ) -> list[ObjectRecord]:
        return [r for r in list(self.object_requests)
                if (resource is None or r.resource == resource) and (op is None or r.op == op)]

    def open_watches(self) -> int:
        return self._call(self._count_watchers())

    def records(self, kind: Literal["list", "watch"], resource: str | None = None
                ) -> list[RequestRecord]:
        return [record for record in list(self.requests) if record.kind == kind
                and (resource is None or record.resource == resource)]

    # -- loop side -------------------------------------------------------------

    def _notify(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def _mutate(self, obj: dict[str, Any], *, deleted: bool) -> str:
        meta = obj["metadata"]
        resource = _RESOURCE_OF_KIND[obj.get("kind", "EndpointSlice")]
        key = (resource, meta.get("namespace", "default"), meta["name"])
        held = self._stored.get(key)
        expected = meta.get("resourceVersion")
        if expected is not None and not deleted and (
                held is None or held["metadata"]["resourceVersion"] != expected):
            kind = WATCHED[resource][2]
            raise Conflict(status_object(
                409, "Conflict", f'Operation cannot be fulfilled on {resource} "{meta["name"]}": '
                "the object has been modified; please apply your changes to the latest version "
                "and try again") | {"details": {"name": meta["name"], "kind": kind}})
        self._rv += 1
        if deleted:
            stored = self._stored.pop(key)
            event_type = "DELETED"
        else:
            event_type = "MODIFIED" if held is not None else "ADDED"
            stored = json.loads(json.dumps(obj))
        stored = {**stored, "metadata": {**stored["metadata"], "resourceVersion": str(self._rv)}}
        if not deleted:
            self._stored[key] = stored
        self._history.append(_Event(self._rv, event_type, key[1], stored, resource,
                                    held if event_type == "MODIFIED" else None))
        self._notify()
        return str(self._rv)

    async def _bookmark(self) -> str:
        self._rv += 1
        obj = {"metadata": {"resourceVersion": str(self._rv)}}  # kind: the watcher's
        self._history.append(_Event(self._rv, "BOOKMARK", None, obj))
        self._notify()
        return str(self._rv)

    async def _compact(self, form: GoneForm) -> None:
        self.gone_form, self._compacted_rv = form, self._rv

    async def _command(self, command: Literal["expire", "drop"]) -> None:
        for watcher in self._watchers:
            watcher.command = command
        self._notify()

    async def _add_failures(self, failures: list[tuple[str, int, str | None]]) -> None:
        self._failures.extend(failures)

    async def _clear_failures(self) -> None:
        self._failures.clear()

    async def _count_watchers(self) -> int:
        return len(self._watchers)

    async def _add(self, target: list[Any], *items: Any) -> None:
        target.extend(items)

    async def _get_object(self, resource: str, namespace: str, name: str
                          ) -> dict[str, Any] | None:
        stored = self._objects.get((resource, namespace, name))
        return json.loads(json.dumps(stored)) if stored is not None else None

    async def _modify(self, resource: str, namespace: str, name: str,
                      change: Callable[[dict[str, Any]], None]) -> str:
        stored = self._objects[(resource, namespace, name)]
        change(stored)
        self._rv += 1
        stored["metadata"]["resourceVersion"] = str(self._rv)
        return str(self._rv)

    async def _add_site(self) -> int:
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._sites.append(site)
        server = site._server  # noqa: SLF001 - aiohttp exposes the port only here
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def _set_partition(self, port: int, cut: bool) -> None:
        if cut:
            self._partitioned.add(port)
        else:
            self._partitioned.discard(port)

    def _take(self, items: list[Any], resource: str, op: str) -> Any:
        for index, item in enumerate(items):
            if item[0] == resource and item[1] == op:
                del items[index]
                return item[2]
        return None

    def _take_failure(self, kind: str, resource: str) -> int | None:
        for index, (failing_kind, status, failing) in enumerate(self._failures):
            if failing_kind == kind and failing in (None, resource):
                del self._failures[index]
                return status
        return None

    # -- Leases and ConfigMaps: HTTP -----------------------------------------------

    def _object_handler(self, resource: str, op: ObjectOp
                        ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._serve_object(request, resource, op)
        return handle


    async def _serve_object(self, request: web.Request, resource: str, op: ObjectOp
                            ) -> web.StreamResponse:
        namespace = request.match_info["namespace"]
        body: dict[str, Any] | None = None
        if op != "get":
            try:
                body = json.loads(await request.read())
            except ValueError:
                return web.json_response(status_object(400, "BadRequest", "invalid JSON body"),
                                         status=400)
            if not isinstance(body, dict):
                return web.json_response(status_object(400, "BadRequest", "expected an object"),
                                         status=400)
        meta = (body or {}).get("metadata") or {}
        name = request.match_info.get("name") or meta.get("name") or ""
        sockname = request.transport.get_extra_info("sockname") if request.transport else None
        port = int(sockname[1]) if sockname else 0
        record = ObjectRecord(resource, op, namespace, name,
                              meta.get("resourceVersion") if op == "replace" else None, port)
        index = len(self.object_requests)
        self.object_requests.append(record)
        while port in self._partitioned and not self._stopping:
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # the client gave up; nothing was done
            await asyncio.sleep(_POLL_S)
        delay = self._take(self._object_delays, resource, op)
        if delay:
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not self._stopping:
                await asyncio.sleep(_POLL_S)
            if request.transport is None or request.transport.is_closing():
                self.object_requests[index] = replace_record(record, 499)
                return web.Response(status=499)  # the client timed out; not carried out
        response = self._object_answer(resource, op, namespace, name, body)
        self.object_requests[index] = replace_record(record, response.status)
        return response


    def _object_answer(self, resource: str, op: ObjectOp, namespace: str, name: str,
                       body: dict[str, Any] | None) -> web.Response:
        key = (resource, namespace, name)
        change = self._take(self._before, resource, op)
        if change is not None and key in self._objects:
            stored = self._objects[key]
            change(stored)
            self._rv += 1
            stored["metadata"]["resourceVersion"] = str(self._rv)
        failure = self._take(self._object_failures, resource, op)
        if failure is not None:
            reason = _REASONS.get(failure, "InternalError")
            return web.json_response(object_status(failure, reason, f"injected {failure}",
                                                    resource, name), status=failure)
        qualified = _qualified(resource)
        stored = self._objects.get(key)
        if op == "get":
            if stored is None:
                return web.json_response(object_status(404, "NotFound",
                                                       f'{qualified} "{name}" not found',
                                                       resource, name), status=404)
            return web.json_response(stored)
        assert body is not None
        _path, api_version, kind, _group = OBJECT_RESOURCES[resource]
        problem = _PROBLEMS[resource](body)
        if problem is not None:
            return web.json_response(object_status(422, "Invalid",
                                                   f'{kind} "{name}" is invalid: {problem}',
                                                   resource, name), status=422)
        if op == "create":
            if stored is not None:
                return web.json_response(object_status(409, "AlreadyExists",
                                                       f'{qualified} "{name}" already exists',
                                                       resource, name), status=409)
            meta = {**(body.get("metadata") or {}), "name": name, "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        else:
            if stored is None:
                return web.json_response(object_status(404, "NotFound",
                                                       f'{qualified} "{name}" not found',
                                                       resource, name), status=404)
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent is not None and sent != stored["metadata"]["resourceVersion"]:
                return web.json_response(object_status(
                    409, "Conflict", f'Operation cannot be fulfilled on {qualified} "{name}": the '
                    f"object has been modified; please apply your changes to the latest version "
                    f"and try again", resource, name), status=409)
            meta = {**(body.get("metadata") or {}), "name": name, "namespace": namespace,
                    "uid": stored["metadata"]["uid"],
                    "creationTimestamp": stored["metadata"]["creationTimestamp"]}
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        obj = {**json.loads(json.dumps(body)), "kind": kind, "apiVersion": api_version,
               "metadata": meta}
        self._objects[key] = obj
        return web.json_response(obj, status=201 if op == "create" else 200)

    # -- HTTP ------------------------------------------------------------------

    def _list_watch_handler(self, resource: str
                            ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._handle(request, resource)
        return handle

    async def _handle(self, request: web.Request, resource: str) -> web.StreamResponse:
        query = request.query
        watch = query.get("watch", "").lower() in ("true", "1")
        timeout = query.get("timeoutSeconds")
        record = RequestRecord(
            kind="watch" if watch else "list", namespace=request.match_info["namespace"],
            label_selector=query.get("labelSelector"),
            resource_version=query.get("resourceVersion"),
            allow_bookmarks=query.get("allowWatchBookmarks", "").lower() in ("true", "1"),
            timeout_seconds=int(timeout) if timeout else None, resource=resource,
            field_selector=query.get("fieldSelector"))
        self.requests.append(record)
        fields = _parse_selector(record.field_selector)
        unknown = sorted(set(fields) - {"metadata.name", "metadata.namespace"})
        if unknown:  # the API server's answer for a field it does not index
            return web.json_response(status_object(
                400, "BadRequest", f'"{unknown[0]}" is not a known field selector: only '
                '"metadata.name", "metadata.namespace"'), status=400)
        failure = self._take_failure(record.kind, resource)
        if failure is not None:
            return web.json_response(status_object(failure, _REASONS.get(failure, "InternalError"),
                                                   "injected"), status=failure)
        return await (self._watch(request, record) if watch else self._list(record))

    def _current(self, record: RequestRecord) -> list[dict[str, Any]]:
        selector = _parse_selector(record.label_selector)
        fields = _parse_selector(record.field_selector)
        return [obj for (resource, namespace, _), obj in sorted(self._stored.items())
                if resource == record.resource and namespace == record.namespace
                and _matches(obj, selector, fields)]

    async def _list(self, record: RequestRecord) -> web.Response:
        _path, api_version, kind = WATCHED[record.resource]
        return web.json_response({
            "kind": f"{kind}List", "apiVersion": api_version,
            "metadata": {"resourceVersion": str(self._rv)},
            "items": self._current(record),
        })

    async def _watch(self, request: web.Request, record: RequestRecord) -> web.StreamResponse:
        rv_text = record.resource_version
        too_old = rv_text not in (None, "", "0") and int(rv_text) < self._compacted_rv
        gone = status_object(410, "Expired", f"too old resource version: {rv_text} ({self._rv})")
        if too_old and self.gone_form == "http":
            return web.json_response(gone, status=410)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if too_old:
            await resp.write(_line("ERROR", gone))
            await resp.write_eof()
            return resp
        watcher = _Watcher(record.namespace, _parse_selector(record.label_selector),
                           record.allow_bookmarks, self._rv, resource=record.resource,
                           fields=_parse_selector(record.field_selector))
        if rv_text in (None, "", "0"):  # "any": start with synthetic ADDED events
            initial = b"".join(_line("ADDED", obj) for obj in self._current(record))
        else:
            watcher.cursor, initial = int(rv_text), b""
        self._watchers.add(watcher)
        try:
            await resp.write(initial)
            if await self._serve(request, resp, watcher, record.timeout_seconds):
                await resp.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self._watchers.discard(watcher)
        return resp

    async def _serve(self, request: web.Request, resp: web.StreamResponse, watcher: _Watcher,
                     timeout_seconds: int | None) -> bool:
        """Stream events until the timeout, a command or shutdown; False if the link was cut."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds if timeout_seconds else None
        while not self._stopping:
            changed = self._changed
            assert changed is not None
            await resp.write(self._pending(watcher))
            if watcher.command == "expire":
                await resp.write(_line("ERROR", status_object(410, "Expired", "expired")))
                return True
            if watcher.command == "drop":
                assert request.transport is not None
                request.transport.abort()
                return False
            if request.transport is None or request.transport.is_closing():
                return False  # the client went away
            remaining = _POLL_S if deadline is None else deadline - loop.time()
            if remaining <= 0:
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, _POLL_S))
        return True

    def _pending(self, watcher: _Watcher) -> bytes:
        chunks = []
        for event in self._history:
            if event.rv <= watcher.cursor:
                continue
            watcher.cursor = event.rv
            if event.namespace is None:
                if watcher.bookmarks:
                    _path, api_version, kind = WATCHED[watcher.resource]
                    chunks.append(_line(event.type, {"kind": kind, "apiVersion": api_version,
                                                     **event.obj}))
            elif event.resource == watcher.resource and event.namespace == watcher.namespace:
                event_type = _as_seen(event, watcher)
                if event_type is not None:
                    chunks.append(_line(event_type, event.obj))
        return b"".join(chunks)


# -- Leases and ConfigMaps --------------------------------------------------------------

_REASONS = {400: "BadRequest", 404: "NotFound", 409: "Conflict", 410: "Gone", 422: "Invalid",
            429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


def object_status(code: int, reason: str, message: str, resource: str, name: str
                  ) -> dict[str, Any]:
    """A Status body as the API server sends it for one object."""
    body = status_object(code, reason, message)
    body["details"] = {"name": name, "group": OBJECT_RESOURCES[resource][3], "kind": resource}
    return body


def _qualified(resource: str) -> str:
    group = OBJECT_RESOURCES[resource][3]
    return f"{resource}.{group}" if group else resource


def _lease_problem(obj: dict[str, Any]) -> str | None:
    spec = obj.get("spec") or {}
    for key in ("acquireTime", "renewTime"):
        value = spec.get(key)
        if value is not None and not (isinstance(value, str) and _MICROTIME.match(value)):
            return f"spec.{key}: {value!r} is not an RFC 3339 MicroTime"
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or isinstance(duration, bool)
                                 or duration <= 0):
        return f"spec.leaseDurationSeconds: must be a positive integer, got {duration!r}"
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        return f"spec.leaseTransitions: must be >= 0, got {transitions!r}"
    return None


def _configmap_problem(obj: dict[str, Any]) -> str | None:
    data = obj.get("data") or {}
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        return "data: values must be strings"
    size = sum(len(k) + len(v.encode()) for k, v in data.items())
    if size > CONFIGMAP_MAX_BYTES:
        return f"data: Too long: must have at most {CONFIGMAP_MAX_BYTES} bytes"
    return None


_PROBLEMS = {"leases": _lease_problem, "configmaps": _configmap_problem}


def replace_record(record: ObjectRecord, status: int) -> ObjectRecord:
    return ObjectRecord(record.resource, record.op, record.namespace, record.name,
                        record.resource_version, record.port, status)
