"""Incremental (Delta) xDS streams."""

from __future__ import annotations

from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds.machine.base import Stream, names_size
from xds_server.xds.machine.bounds import check_each
from xds_server.xds.machine.events import Event, Response, StaleNonce, Subscription
from xds_server.xds.machine.state import WILDCARD, TypeState
from xds_server.xds.snapshot import Resource, Snapshot


class DeltaStream(Stream):
    """Incremental xDS: subscriptions arrive as diffs; responses carry only changed resources
    and the names removed. ACKs and NACKs carry no version, only the nonce."""

    def _field(self, res: Resource) -> bytes:
        return res.delta_field

    def receive(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[Event]:
        self._note_node(request)
        self._check_envelope(request.type_url, request.response_nonce)
        type_url = self._type_of(request.type_url)
        first = type_url not in self.types
        self._check_names(type_url, len(request.resource_names_subscribe), slack=1)
        self._check_names(type_url, len(request.resource_names_unsubscribe),
                          "unsubscribes from", slack=1)
        self._check_resource_names("resource_names_subscribe", request.resource_names_subscribe)
        self._check_resource_names("resource_names_unsubscribe",
                                   request.resource_names_unsubscribe)
        held = self._initial_versions(type_url, request) if first else {}
        st = self.types.setdefault(type_url, TypeState(type_url))
        events: list[Event] = []
        nonce = request.response_nonce
        if nonce and nonce == st.pending_nonce:
            error = request.error_detail if request.HasField("error_detail") else None
            events.append(self._settle(st, nonce, "", error))
        elif nonce and nonce != st.last_nonce:
            events.append(StaleNonce(type_url, nonce))
        if first:
            st.sent = held
            st.force = not st.sent
            st.wildcard = not request.resource_names_subscribe  # legacy wildcard
        events += self._subscribe(st, request, first)
        return events

    def _initial_versions(self, type_url: str, request: discovery_pb2.DeltaDiscoveryRequest
                          ) -> dict[str, str]:
        """The names and versions the client says it holds, checked and charged to the
        stream's subscription budget (for the stream's life)."""
        self._check_names(type_url, len(request.initial_resource_versions),
                          "names as held (initial_resource_versions)")
        held = dict(request.initial_resource_versions)
        self._check_resource_names("initial_resource_versions", held)
        check_each("a version in initial_resource_versions", held.values(),
                   self.limits.fields.version_info)
        self._hold(names_size(held) + names_size(held.values()))
        return held

    def _subscribe(self, st: TypeState, request: discovery_pb2.DeltaDiscoveryRequest,
                   first: bool) -> list[Event]:
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
        change = names_size((added - dropped) - st.names) - names_size(dropped & st.names)
        self._hold(change)
        st.name_bytes += change
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
