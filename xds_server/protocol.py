"""The xDS stream as a sans-IO state machine (SotW and Delta).

Requests go in with `receive()`, which returns events (ACK, NACK, stale nonce, ...). Given the
current snapshot, `responses()` returns what must be sent now. No I/O, no clocks, no gRPC: the
transport only pumps messages in and out.

Flow control: at most one response per type is in flight. Until the client ACKs or NACKs it,
newer snapshots for that type wait, and are coalesced to the latest when the reply arrives.

NACKs: the versions a client rejected are remembered, and never sent to it again; the next
*different* version is. For SotW Cluster/Listener (whole-state types) the rejected unit is the
whole set; for every other case it is the individual resource version.

Cost per wake: a type is evaluated only when the snapshot's version of it differs from the one
it was last evaluated at (or its subscription changed, or an answer is forced); evaluating it
then looks only at the resources that changed since, when the snapshot records them (see
`Snapshot.changes`). A new snapshot that changed only EDS thus costs every stream one EDS
evaluation over the changed CLAs, and the ACKs that follow cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from . import type_urls
from .snapshot import Resource, Snapshot

WILDCARD = "*"
_ADS_RANK = {type_url: i for i, type_url in enumerate(type_urls.ADS_ORDER)}


class ProtocolError(Exception):
    """The peer's fault: a request that breaks the xDS protocol."""


@dataclass(frozen=True)
class Ack:
    type_url: str
    nonce: str
    version: str


@dataclass(frozen=True)
class Nack:
    type_url: str
    nonce: str
    version: str
    detail: str
    rejected: Mapping[str, str]  # resource name -> version we sent and the client refused


@dataclass(frozen=True)
class StaleNonce:
    type_url: str
    nonce: str


@dataclass(frozen=True)
class Subscription:
    type_url: str
    wildcard: bool
    names: frozenset[str]


Event = Ack | Nack | StaleNonce | Subscription


@dataclass(frozen=True)
class Response:
    """A response to send. `resources` are shared snapshot objects; `removed` is Delta only."""

    type_url: str
    version: str
    nonce: str
    resources: tuple[Resource, ...]
    removed: tuple[str, ...] = ()


@dataclass
class Rejections:
    """Versions a node has NACKed, per type. Kept across that node's reconnects."""

    resources: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # type -> name -> versions
    states: dict[str, set[str]] = field(default_factory=dict)  # type -> whole-state versions

    def resource_rejected(self, type_url: str, name: str, version: str) -> bool:
        return version in self.resources.get(type_url, {}).get(name, ())

    def of_type(self, type_url: str) -> Mapping[str, set[str]]:
        """name -> rejected versions, for `type_url` (read-only use)."""
        return self.resources.get(type_url, {})

    def record(self, type_url: str, rejected: Mapping[str, str], state_version: str | None) -> None:
        by_name = self.resources.setdefault(type_url, {})
        for name, version in rejected.items():
            by_name.setdefault(name, set()).add(version)
        if state_version is not None:
            self.states.setdefault(type_url, set()).add(state_version)


@dataclass
class TypeState:
    type_url: str
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    sent: dict[str, str] = field(default_factory=dict)  # name -> version the client was sent/holds
    sent_state: str | None = None  # SotW whole-state version last sent
    pending_nonce: str | None = None  # awaiting ACK/NACK
    pending: dict[str, str] = field(default_factory=dict)
    pending_state: str | None = None
    pending_version: str = ""  # the version the pending response carried
    last_nonce: str = ""
    force: bool = False  # the client needs an answer even if nothing changed
    acked_version: str = ""
    # The snapshot's version of this type when it was last evaluated; None: evaluate in full.
    # Reset whenever the subscription or `sent` changes other than by an evaluation.
    evaluated: str | None = None

    def wanted(self, snapshot: Snapshot) -> Mapping[str, Resource]:
        """The subscribed resources, in name order (shared: do not modify)."""
        if self.wildcard:
            return snapshot.of_type(self.type_url)
        return snapshot.subset(self.type_url, self.names)[0]

    def wanted_version(self, snapshot: Snapshot) -> str:
        """`type_version(self.wanted(snapshot))`, without computing it per stream."""
        if self.wildcard:
            return snapshot.type_version_of(self.type_url)
        return snapshot.subset(self.type_url, self.names)[1]

    def up_to_date(self, snapshot: Snapshot) -> bool:
        """Evaluating now would give what the last evaluation gave: nothing to send."""
        return not self.force and self.evaluated == snapshot.type_version_of(self.type_url)

    def changed_names(self, snapshot: Snapshot) -> frozenset[str] | None:
        """The names that changed since the last evaluation, or None if unknown (then every
        wanted resource must be looked at)."""
        if self.force or self.evaluated is None:
            return None
        change = snapshot.changes.get(self.type_url)
        if change is None or change.since != self.evaluated:
            return None
        return change.names

    def wanted_changes(self, snapshot: Snapshot) -> Iterable[tuple[str, Resource]]:
        """The wanted resources whose version may differ from `sent`, in name order."""
        names = self.changed_names(snapshot)
        if names is None:
            return self.wanted(snapshot).items()
        have = snapshot.of_type(self.type_url)
        return [(name, have[name]) for name in sorted(names)
                if name in have and (self.wildcard or name in self.names)]


def _error_detail(status: object) -> str:
    return getattr(status, "message", "") or f"code {getattr(status, 'code', '?')}"


class _Stream:
    """What SotW and Delta streams share: node, nonces, per-type state, rejections."""

    def __init__(self, default_type_url: str | None = None,
                 rejections: Rejections | None = None) -> None:
        self.default_type_url = default_type_url
        self.node: base_pb2.Node | None = None
        self.types: dict[str, TypeState] = {}
        self.rejections = rejections if rejections is not None else Rejections()
        self._counter = 0

    def _note_node(self, request: discovery_pb2.DiscoveryRequest
                   | discovery_pb2.DeltaDiscoveryRequest) -> None:
        if request.HasField("node"):
            self.node = request.node

    def _type_of(self, type_url: str) -> str:
        if self.default_type_url is not None:
            if type_url and type_url != self.default_type_url:
                raise ProtocolError(f"type_url {type_url!r} sent on the "
                                    f"{type_urls.short_name(self.default_type_url)} service")
            return self.default_type_url
        if not type_url:
            raise ProtocolError("request without type_url on an aggregated (ADS) stream")
        return type_url

    def _next_nonce(self) -> str:
        self._counter += 1
        return str(self._counter)

    def _settle(self, st: TypeState, nonce: str, version: str, error: object | None) -> Event:
        """The client answered the pending response `nonce` with an ACK or a NACK. An ACK
        without a version (every Delta ACK) accepted the version that response carried."""
        pending, state, sent_version = st.pending, st.pending_state, st.pending_version
        st.pending_nonce, st.pending, st.pending_state, st.pending_version = None, {}, None, ""
        if error is None:
            st.acked_version = version or sent_version
            return Ack(st.type_url, nonce, st.acked_version)
        self.rejections.record(st.type_url, pending, state)
        return Nack(st.type_url, nonce, version, _error_detail(error), dict(pending))

    def _emit(self, st: TypeState, version: str, resources: list[Resource],
              removed: tuple[str, ...] = (), state: str | None = None) -> Response:
        nonce = self._next_nonce()
        st.pending_nonce = st.last_nonce = nonce
        st.pending = {res.name: res.version for res in resources}
        st.pending_state, st.pending_version = state, version
        st.force = False
        return Response(st.type_url, version, nonce, tuple(resources), removed)

    def _ready_types(self) -> list[TypeState]:
        """Requested types with no response in flight, in ADS order (CDS, EDS, LDS, RDS)."""
        ready = [st for st in self.types.values() if st.pending_nonce is None]
        return sorted(ready, key=lambda st: (_ADS_RANK.get(st.type_url, len(_ADS_RANK)),
                                             st.type_url))

    def responses(self, snapshot: Snapshot | None) -> list[Response]:
        """What must be sent now. A type whose snapshot version is the one it was last
        evaluated at is skipped: rejections only grow, so nothing new would be sent."""
        if snapshot is None:
            return []
        out = []
        for st in self._ready_types():
            if st.up_to_date(snapshot):
                continue
            response = self._respond(st, snapshot)
            st.evaluated = snapshot.type_version_of(st.type_url)
            if response is not None:
                out.append(response)
        return out

    def _respond(self, st: TypeState, snapshot: Snapshot) -> Response | None:
        raise NotImplementedError


class SotwStream(_Stream):
    """State of the World: each request names the full subscription; responses are ACKed by the
    next request carrying their nonce."""

    def receive(self, request: discovery_pb2.DiscoveryRequest) -> list[Event]:
        self._note_node(request)
        type_url = self._type_of(request.type_url)
        st = self.types.get(type_url)
        nonce = request.response_nonce
        if st is not None and nonce and nonce != st.last_nonce:
            return [StaleNonce(type_url, nonce)]
        first = st is None
        if st is None:
            st = self.types[type_url] = TypeState(type_url)
        events: list[Event] = []
        if nonce and nonce == st.pending_nonce:
            error = request.error_detail if request.HasField("error_detail") else None
            events.append(self._settle(st, nonce, request.version_info, error))
        events += self._subscribe(st, request)
        if first or not nonce:
            self._initial(st, request.version_info)
        return events

    def _subscribe(self, st: TypeState, request: discovery_pb2.DiscoveryRequest) -> list[Event]:
        names = set(request.resource_names)
        wildcard = WILDCARD in names or (not names and st.type_url in type_urls.FULL_STATE_TYPES)
        names.discard(WILDCARD)
        if wildcard == st.wildcard and names == st.names and request.response_nonce:
            return []
        for gone in st.names - names:
            st.sent.pop(gone, None)
        st.wildcard, st.names, st.evaluated = wildcard, frozenset(names), None
        return [Subscription(st.type_url, wildcard, st.names)]

    def _initial(self, st: TypeState, client_version: str) -> None:
        """A request without nonce: a new stream or a re-subscription. It gets an answer unless
        the version it already holds (after a reconnect) is the one we would send."""
        st.pending_nonce, st.pending, st.pending_state, st.pending_version = None, {}, None, ""
        st.sent, st.sent_state, st.force = {}, None, True
        st.acked_version, st.evaluated = client_version, None

    def _respond(self, st: TypeState, snapshot: Snapshot) -> Response | None:
        version = st.wanted_version(snapshot)
        if st.force and st.acked_version and st.acked_version == version:
            st.force = False  # reconnected client already holds exactly this
            st.sent = {name: res.version for name, res in st.wanted(snapshot).items()}
            st.sent_state = version
            return None
        if st.type_url in type_urls.FULL_STATE_TYPES:
            return self._respond_full(st, snapshot, version)
        return self._respond_partial(st, snapshot, version)

    def _respond_full(self, st: TypeState, snapshot: Snapshot, version: str) -> Response | None:
        if version in self.rejections.states.get(st.type_url, ()):
            return None
        if not st.force and version == st.sent_state:
            return None
        wanted = st.wanted(snapshot)
        st.sent = {name: res.version for name, res in wanted.items()}
        st.sent_state = version
        return self._emit(st, version, list(wanted.values()), state=version)

    def _respond_partial(self, st: TypeState, snapshot: Snapshot,
                         version: str) -> Response | None:
        rejected = self.rejections.of_type(st.type_url)
        changed = [res for name, res in st.wanted_changes(snapshot)
                   if (st.force or st.sent.get(name) != res.version)
                   and res.version not in rejected.get(name, ())]
        if not changed:
            st.force = False
            return None
        for res in changed:
            st.sent[res.name] = res.version
        return self._emit(st, version, changed)


class DeltaStream(_Stream):
    """Incremental xDS: subscriptions arrive as diffs; responses carry only changed resources
    and the names removed. ACKs and NACKs carry no version, only the nonce."""

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[Event]:
        self._note_node(request)
        type_url = self._type_of(request.type_url)
        first = type_url not in self.types
        st = self.types.setdefault(type_url, TypeState(type_url))
        events: list[Event] = []
        nonce = request.response_nonce
        if nonce and nonce == st.pending_nonce:
            error = request.error_detail if request.HasField("error_detail") else None
            events.append(self._settle(st, nonce, "", error))
        elif nonce and nonce != st.last_nonce:
            events.append(StaleNonce(type_url, nonce))
        if first:
            st.sent = dict(request.initial_resource_versions)
            st.force = not st.sent
            st.wildcard = not request.resource_names_subscribe  # legacy wildcard
        events += self._subscribe(st, request, first)
        return events

    def _subscribe(self, st: TypeState, request: discovery_pb2.DeltaDiscoveryRequest,
                   first: bool) -> list[Event]:
        added, dropped = set(request.resource_names_subscribe), set(request.resource_names_unsubscribe)
        if not added and not dropped:
            return []
        if WILDCARD in added:
            st.wildcard = True
        if WILDCARD in dropped:
            st.wildcard = False
        added.discard(WILDCARD)
        dropped.discard(WILDCARD)
        for name in added - st.names:
            if not first:
                st.sent.pop(name, None)  # a fresh subscription gets the resource even if known
        st.names = (st.names | added) - dropped
        for name in dropped:
            if not st.wildcard:
                st.sent.pop(name, None)
        st.evaluated = None
        return [Subscription(st.type_url, st.wildcard, st.names)]

    def _respond(self, st: TypeState, snapshot: Snapshot) -> Response | None:
        rejected = self.rejections.of_type(st.type_url)
        changed = [res for name, res in st.wanted_changes(snapshot)
                   if st.sent.get(name) != res.version
                   and res.version not in rejected.get(name, ())]
        removed = self._removed(st, snapshot)
        if not changed and not removed and not st.force:
            return None
        for res in changed:
            st.sent[res.name] = res.version
        for name in removed:
            del st.sent[name]
        return self._emit(st, snapshot.versions.get(st.type_url, ""), changed, removed)

    @staticmethod
    def _removed(st: TypeState, snapshot: Snapshot) -> tuple[str, ...]:
        """Subscribed names the client holds that the snapshot no longer has, sorted."""
        have = snapshot.of_type(st.type_url)
        names = st.changed_names(snapshot)
        held = st.sent if names is None else [name for name in names if name in st.sent]
        return tuple(sorted(name for name in held
                            if name not in have and (st.wildcard or name in st.names)))
