"""The xDS stream as a sans-IO state machine (SotW and Delta).

Requests go in with `receive()`, which returns events (ACK, NACK, stale nonce, ...). Given the
current snapshot, `responses()` returns what must be sent now. No I/O, no clocks, no gRPC: the
transport only pumps messages in and out.

Flow control: at most one response per type is in flight. Until the client ACKs or NACKs it,
newer snapshots for that type wait, and are coalesced to the latest when the reply arrives.

NACKs: the versions a stream rejected are remembered *by that stream* (never by node id, which
any client can claim), and never sent on it again; the next *different* version is. A new
stream starts with no NACK memory and gets the current state, so a version is NACKed at most
once per stream. For SotW Cluster/Listener (whole-state types) the rejected unit is the whole
set; for every other case it is the individual resource version.

Limits (`StreamLimits`): a request subscribing to more than `max_resource_names` names of one
type ends the stream (`ResourceLimitExceeded`, the peer's fault). No response is larger than
`max_response_bytes` less `RESPONSE_HEADROOM`: SotW EDS/RDS and every Delta type are split
into several responses ("parts"), sent one at a time under the same flow control; SotW
CDS/LDS must carry the whole state in one response, so one that does not fit is withheld, as is
a single resource that does not fit (`Withheld` notices, our fault).

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

from xds_server.xds import encode as wire
from xds_server.xds import type_urls
from xds_server.xds.snapshot import Resource, Snapshot

WILDCARD = "*"
_ADS_RANK = {type_url: i for i, type_url in enumerate(type_urls.ADS_ORDER)}

MAX_RESOURCE_NAMES = 16_384  # names of one type one stream may subscribe to
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # gRPC clients' default receive limit per message
# Reserved below max_response_bytes for what packing does not count: the envelope fields
# (version, type URL, nonce; well under 300 bytes) and gRPC's 5-byte message prefix.
RESPONSE_HEADROOM = 1024
MAX_REJECTED_VERSIONS = 8  # rejected versions remembered per resource (or whole state) per type


class ProtocolError(Exception):
    """The peer's fault: a request that breaks the xDS protocol."""


class ResourceLimitExceeded(ProtocolError):
    """The peer's fault: a request naming more resources than this server accepts."""


@dataclass(frozen=True)
class StreamLimits:
    """What one stream may ask for and be sent (`xds.limits` in the config)."""

    max_resource_names: int = MAX_RESOURCE_NAMES
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if self.max_resource_names < 1:
            raise ValueError(f"max_resource_names must be >= 1, got {self.max_resource_names}")
        if self.max_response_bytes <= RESPONSE_HEADROOM:
            raise ValueError(f"max_response_bytes must be above {RESPONSE_HEADROOM}, got "
                             f"{self.max_response_bytes}")

    @property
    def part_bytes(self) -> int:
        """The most resource (and removed-name) bytes one response may carry."""
        return self.max_response_bytes - RESPONSE_HEADROOM


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
class Withheld:
    """Our fault: resources not sent because they cannot fit in one response. `names` is every
    resource of a SotW whole-state type, or the one resource that alone is too large."""

    type_url: str
    version: str
    names: tuple[str, ...]
    size: int  # bytes they need
    limit: int  # bytes a response may carry


@dataclass(frozen=True)
class Response:
    """A response to send. `resources` are shared snapshot objects; `removed` is Delta only."""

    type_url: str
    version: str
    nonce: str
    resources: tuple[Resource, ...]
    removed: tuple[str, ...] = ()


def _remember(versions: tuple[str, ...], version: str) -> tuple[str, ...]:
    """`versions` plus `version`, the oldest forgotten beyond MAX_REJECTED_VERSIONS."""
    if version in versions:
        return versions
    return (*versions, version)[-MAX_REJECTED_VERSIONS:]


@dataclass
class Rejections:
    """Versions one stream must not be sent again, per type: the ones it NACKed, and the ones
    withheld from it as too large. Never shared between streams: what one client rejects (or
    claims to) cannot suppress another's config. Bounded: at most MAX_REJECTED_VERSIONS per
    resource name (names come from our own snapshots) and per type for whole states."""

    resources: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # type -> name -> versions
    states: dict[str, tuple[str, ...]] = field(default_factory=dict)  # type -> whole-state versions

    def resource_rejected(self, type_url: str, name: str, version: str) -> bool:
        return version in self.resources.get(type_url, {}).get(name, ())

    def state_rejected(self, type_url: str, version: str) -> bool:
        return version in self.states.get(type_url, ())

    def of_type(self, type_url: str) -> Mapping[str, tuple[str, ...]]:
        """name -> rejected versions, for `type_url` (read-only use)."""
        return self.resources.get(type_url, {})

    def record(self, type_url: str, rejected: Mapping[str, str], state_version: str | None) -> None:
        by_name = self.resources.setdefault(type_url, {})
        for name, version in rejected.items():
            by_name[name] = _remember(by_name.get(name, ()), version)
        if state_version is not None:
            self.states[type_url] = _remember(self.states.get(type_url, ()), state_version)


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
    more: bool = False  # the last response was a part: more of that push is still to be sent
    # `names` among the snapshot's names of this type, and the (names, snapshot names) objects
    # it was computed from: the memo key of `Snapshot.subset`, never larger than the snapshot.
    _present: frozenset[str] = field(default=frozenset(), repr=False)
    _present_basis: tuple[frozenset[str], frozenset[str]] | None = field(default=None, repr=False)

    def present(self, snapshot: Snapshot) -> frozenset[str]:
        """The subscribed names the snapshot has (recomputed only when either side changed)."""
        have = snapshot.names_of(self.type_url)
        basis = self._present_basis
        if basis is None or basis[0] is not self.names or basis[1] is not have:
            self._present = self.names & have
            self._present_basis = (self.names, have)
        return self._present

    def wanted(self, snapshot: Snapshot) -> Mapping[str, Resource]:
        """The subscribed resources, in name order (shared: do not modify)."""
        if self.wildcard:
            return snapshot.of_type(self.type_url)
        return snapshot.subset(self.type_url, self.present(snapshot))[0]

    def wanted_version(self, snapshot: Snapshot) -> str:
        """`type_version(self.wanted(snapshot))`, without computing it per stream."""
        if self.wildcard:
            return snapshot.type_version_of(self.type_url)
        return snapshot.subset(self.type_url, self.present(snapshot))[1]

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


def part_version(version: str, rest: int) -> str:
    """The version a part of a push carries: `version` on the last part, `version+N` (N
    resources still to come) before it. A client that reconnects holding only some parts so
    reports a version that matches no whole state, and is sent everything again."""
    return f"{version}+{rest}" if rest else version


@dataclass
class _Part:
    """What one response of a (possibly split) push carries."""

    resources: list[Resource] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rest: int = 0  # resources and removed names left for later parts


class _Stream:
    """What SotW and Delta streams share: node, nonces, per-type state, rejections, limits."""

    def __init__(self, default_type_url: str | None = None,
                 limits: StreamLimits | None = None) -> None:
        self.default_type_url = default_type_url
        self.limits = limits if limits is not None else StreamLimits()
        self.node: base_pb2.Node | None = None
        self.types: dict[str, TypeState] = {}
        self.rejections = Rejections()  # this stream's only: never shared, never kept after it
        self.notices: list[Withheld] = []  # for the transport to log (`take_notices`)
        self._greeted = False  # the first request has been received
        self._counter = 0

    def _note_node(self, request: discovery_pb2.DiscoveryRequest
                   | discovery_pb2.DeltaDiscoveryRequest) -> None:
        """The stream's node is its first request's, the one it was authorised as; a node
        on a later request is ignored (it may not switch identity mid-stream)."""
        if self._greeted:
            return
        self._greeted = True
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

    def _check_names(self, type_url: str, count: int, what: str = "subscribes to",
                     slack: int = 0) -> None:
        """Refuse a request naming more than `max_resource_names`. Checked first on the raw
        count (cheap: a hostile request is refused before any set of its names is built),
        then on the distinct names the subscription would hold."""
        limit = self.limits.max_resource_names
        if count - slack > limit:
            raise ResourceLimitExceeded(
                f"the request {what} {count} {type_urls.short_name(type_url)} resource names; "
                f"this server accepts at most {limit} per type and stream "
                f"(xds.limits.max_resource_names)")

    def _next_nonce(self) -> str:
        self._counter += 1
        return str(self._counter)

    def take_notices(self) -> list[Withheld]:
        """The `Withheld` notices since the last call (for the transport to log)."""
        notices, self.notices = self.notices, []
        return notices

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

    def _field(self, res: Resource) -> bytes:
        """The encoded `resources` field this API sends for `res` (shared, encoded once)."""
        raise NotImplementedError

    def _withhold(self, type_url: str, version: str, names: tuple[str, ...], size: int,
                  state: bool) -> None:
        """Never send these (at this version) on this stream: they cannot fit a response."""
        if state:
            self.rejections.record(type_url, {}, version)
        else:
            self.rejections.record(type_url, dict.fromkeys(names, version), None)
        self.notices.append(Withheld(type_url, version, names, size, self.limits.part_bytes))

    def _pack(self, st: TypeState, resources: list[Resource], removed: Iterable[str] = ()
              ) -> _Part:
        """The first part of a push: removed names, then resources, first fit, within the
        byte budget of one response. A resource that alone exceeds it is withheld."""
        budget, used, part = self.limits.part_bytes, 0, _Part()
        for name in removed:
            size = len(wire.delta_removed_field(name))
            if used + size > budget:
                part.rest += 1
                continue
            part.removed.append(name)
            used += size
        for res in resources:
            size = len(self._field(res))
            if size > budget:
                self._withhold(st.type_url, res.version, (res.name,), size, state=False)
            elif used + size > budget:
                part.rest += 1
            else:
                part.resources.append(res)
                used += size
        return part

    def _emit(self, st: TypeState, version: str, resources: list[Resource],
              removed: tuple[str, ...] = (), state: str | None = None, rest: int = 0) -> Response:
        nonce = self._next_nonce()
        version = part_version(version, rest)
        st.pending_nonce = st.last_nonce = nonce
        st.pending = {res.name: res.version for res in resources}
        st.pending_state, st.pending_version = state, version
        st.force = False
        st.more = rest > 0
        return Response(st.type_url, version, nonce, tuple(resources), removed)

    def _ready_types(self) -> list[TypeState]:
        """Requested types with no response in flight, in ADS order (CDS, EDS, LDS, RDS)."""
        ready = [st for st in self.types.values() if st.pending_nonce is None]
        return sorted(ready, key=lambda st: (_ADS_RANK.get(st.type_url, len(_ADS_RANK)),
                                             st.type_url))

    def responses(self, snapshot: Snapshot | None) -> list[Response]:
        """What must be sent now. A type whose snapshot version is the one it was last
        evaluated at is skipped: rejections only grow, so nothing new would be sent. A type
        whose last response was a part (more to come) is evaluated again, in full, once that
        part is answered: what is left of the push is what still differs from `sent`."""
        if snapshot is None:
            return []
        out = []
        for st in self._ready_types():
            if st.up_to_date(snapshot):
                continue
            st.more = False
            response = self._respond(st, snapshot)
            st.evaluated = None if st.more else snapshot.type_version_of(st.type_url)
            if response is not None:
                out.append(response)
        return out

    def _respond(self, st: TypeState, snapshot: Snapshot) -> Response | None:
        raise NotImplementedError


class SotwStream(_Stream):
    """State of the World: each request names the full subscription; responses are ACKed by the
    next request carrying their nonce."""

    def _field(self, res: Resource) -> bytes:
        return res.sotw_field

    def receive(self, request: discovery_pb2.DiscoveryRequest) -> list[Event]:
        self._note_node(request)
        type_url = self._type_of(request.type_url)
        st = self.types.get(type_url)
        nonce = request.response_nonce
        if st is not None and nonce and nonce != st.last_nonce:
            return [StaleNonce(type_url, nonce)]
        first = st is None
        self._check_names(type_url, len(request.resource_names), slack=1)  # one may be "*"
        names = frozenset(request.resource_names)
        wildcard = WILDCARD in names
        if wildcard:
            names = names - {WILDCARD}
        self._check_names(type_url, len(names))
        if st is None:
            st = self.types[type_url] = TypeState(type_url)
        events: list[Event] = []
        if nonce and nonce == st.pending_nonce:
            error = request.error_detail if request.HasField("error_detail") else None
            events.append(self._settle(st, nonce, request.version_info, error))
        events += self._subscribe(st, request, names, wildcard)
        if first or not nonce:
            self._initial(st, request.version_info)
        return events

    def _subscribe(self, st: TypeState, request: discovery_pb2.DiscoveryRequest,
                   names: frozenset[str], wildcard: bool) -> list[Event]:
        wildcard = wildcard or (not names and st.type_url in type_urls.FULL_STATE_TYPES)
        if wildcard == st.wildcard and names == st.names and request.response_nonce:
            return []
        for gone in st.names - names:
            st.sent.pop(gone, None)
        st.wildcard, st.names, st.evaluated = wildcard, names, None
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
        """CDS/LDS: the whole state in one response, never split; withheld if it cannot fit."""
        if self.rejections.state_rejected(st.type_url, version):
            return None
        if not st.force and version == st.sent_state:
            return None
        wanted = st.wanted(snapshot)
        size = sum(len(res.sotw_field) for res in wanted.values())
        if size > self.limits.part_bytes:
            self._withhold(st.type_url, version, tuple(wanted), size, state=True)
            st.force = False
            return None
        st.sent = {name: res.version for name, res in wanted.items()}
        st.sent_state = version
        return self._emit(st, version, list(wanted.values()), state=version)

    def _respond_partial(self, st: TypeState, snapshot: Snapshot,
                         version: str) -> Response | None:
        """EDS/RDS: only what changed, split into parts that each fit one response (Envoy
        applies a SotW EDS/RDS response to the resources it names and keeps the others)."""
        rejected = self.rejections.of_type(st.type_url)
        changed = [res for name, res in st.wanted_changes(snapshot)
                   if (st.force or st.sent.get(name) != res.version)
                   and res.version not in rejected.get(name, ())]
        part = self._pack(st, changed)
        if not part.resources:
            st.force = False
            return None
        for res in part.resources:
            st.sent[res.name] = res.version
        return self._emit(st, version, part.resources, rest=part.rest)


class DeltaStream(_Stream):
    """Incremental xDS: subscriptions arrive as diffs; responses carry only changed resources
    and the names removed. ACKs and NACKs carry no version, only the nonce."""

    def _field(self, res: Resource) -> bytes:
        return res.delta_field

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[Event]:
        self._note_node(request)
        type_url = self._type_of(request.type_url)
        first = type_url not in self.types
        if first:
            self._check_names(type_url, len(request.initial_resource_versions),
                              "names as held (initial_resource_versions)")
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
        self._check_names(st.type_url, len(request.resource_names_subscribe), slack=1)
        added, dropped = set(request.resource_names_subscribe), set(request.resource_names_unsubscribe)
        if not added and not dropped:
            return []
        wildcard = st.wildcard
        if WILDCARD in added:
            wildcard = True
        if WILDCARD in dropped:
            wildcard = False
        added.discard(WILDCARD)
        dropped.discard(WILDCARD)
        names = (st.names | added) - dropped
        self._check_names(st.type_url, len(names))
        st.wildcard = wildcard
        for name in added - st.names:
            if not first:
                st.sent.pop(name, None)  # a fresh subscription gets the resource even if known
        st.names = frozenset(names)
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
        part = self._pack(st, changed, removed)
        if not part.resources and not part.removed and not st.force:
            return None  # everything that changed was withheld
        for res in part.resources:
            st.sent[res.name] = res.version
        for name in part.removed:
            del st.sent[name]
        return self._emit(st, snapshot.versions.get(st.type_url, ""), part.resources,
                          tuple(part.removed), rest=part.rest)

    @staticmethod
    def _removed(st: TypeState, snapshot: Snapshot) -> tuple[str, ...]:
        """Subscribed names the client holds that the snapshot no longer has, sorted."""
        have = snapshot.of_type(st.type_url)
        names = st.changed_names(snapshot)
        held = st.sent if names is None else [name for name in names if name in st.sent]
        return tuple(sorted(name for name in held
                            if name not in have and (st.wildcard or name in st.names)))
