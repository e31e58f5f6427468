"""State of the World streams."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds import type_urls
from xds_server.xds.machine.base import Stream, names_size
from xds_server.xds.machine.bounds import check_text
from xds_server.xds.machine.events import Event, Response, StaleNonce, Subscription
from xds_server.xds.machine.state import WILDCARD, TypeState
from xds_server.xds.snapshot import Resource, Snapshot


class SotwStream(Stream):
    """State of the World: each request names the full subscription; responses are ACKed by the
    next request carrying their nonce."""

    def _field(self, res: Resource) -> bytes:
        return res.sotw_field

    def receive(self, request: discovery_pb2.DiscoveryRequest) -> list[Event]:
        self._note_node(request)
        self._check_envelope(request.type_url, request.response_nonce)
        check_text("version_info", request.version_info, self.limits.fields.version_info)
        type_url = self._type_of(request.type_url)
        st = self.types.get(type_url)
        nonce = request.response_nonce
        if st is not None and nonce and nonce != st.last_nonce:
            return [StaleNonce(type_url, nonce)]
        first = st is None
        self._check_names(type_url, len(request.resource_names), slack=1)  # one may be "*"
        self._check_resource_names("resource_names", request.resource_names)
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
        size = names_size(names)
        self._hold(size - st.name_bytes)
        for gone in st.names - names:
            st.sent.pop(gone, None)
        st.wildcard, st.names, st.evaluated, st.name_bytes = wildcard, names, None, size
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
