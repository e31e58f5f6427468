"""What SotW and Delta streams share: the node, nonces, per-type state, rejections, packing a
push into parts within the byte budget, and one response per type in flight."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import discovery_pb2

from xds_server.xds import encode as wire
from xds_server.xds import type_urls
from xds_server.xds.machine.bounds import bounded_text, check_each, check_node, check_text
from xds_server.xds.machine.events import Ack, Event, Nack, Response, Withheld
from xds_server.xds.machine.limits import ProtocolError, ResourceLimitExceeded, StreamLimits
from xds_server.xds.machine.state import Rejections, TypeState
from xds_server.xds.peer_text import shown, type_name
from xds_server.xds.snapshot import Resource, Snapshot

_ADS_RANK = {type_url: i for i, type_url in enumerate(type_urls.ADS_ORDER)}


def _error_detail(status: object, limit: int) -> str:
    """The NACK's text, truncated to `limit` bytes (Envoy's embed the rejected resource)."""
    message = getattr(status, "message", "")
    return bounded_text(message, limit) if message else f"code {getattr(status, 'code', '?')}"


def names_size(names: Iterable[str]) -> int:
    """The UTF-8 bytes of `names`, all together."""
    return len("".join(names).encode("utf-8", "surrogatepass"))


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


class Stream:
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
        # Bytes of peer-named subscription state held (names, initial_resource_versions).
        self.held_bytes = 0

    def _note_node(self, request: discovery_pb2.DiscoveryRequest
                   | discovery_pb2.DeltaDiscoveryRequest) -> None:
        """The stream's node is its first request's, the one it was authorised as; a node
        on a later request is ignored (it may not switch identity mid-stream)."""
        if self._greeted:
            return
        if request.HasField("node"):
            check_node(request.node, self.limits.fields)
            self.node = request.node
        self._greeted = True

    def _check_envelope(self, type_url: str, nonce: str) -> None:
        """Refuse a type URL or nonce over its bound (both may reach an event or a log)."""
        bounds = self.limits.fields
        check_text("type_url", type_url, bounds.type_url)
        check_text("response_nonce", nonce, bounds.response_nonce)

    def _check_resource_names(self, field: str, names: Iterable[str]) -> None:
        check_each(f"a name in {field}", names, self.limits.fields.resource_name)

    def _hold(self, change: int) -> None:
        """Charge `change` bytes of peer-named subscription state to the stream's budget;
        refused (the stream's end, the peer's fault) when it would go over."""
        held, budget = self.held_bytes + change, self.limits.max_subscription_bytes
        if held > budget:
            raise ResourceLimitExceeded(
                f"the stream's subscriptions would hold {held} bytes of resource names and "
                f"initial_resource_versions; this server accepts at most {budget} per stream "
                f"(the subscription byte budget, StreamLimits.max_subscription_bytes)")
        self.held_bytes = held

    def _type_of(self, type_url: str) -> str:
        if self.default_type_url is not None:
            if type_url and type_url != self.default_type_url:
                raise ProtocolError(f"type_url {shown(type_url, 100)} sent on the "
                                    f"{type_urls.short_name(self.default_type_url)} service")
            return self.default_type_url
        if not type_url:
            raise ProtocolError("request without type_url on an aggregated (ADS) stream")
        if type_url not in self.types and len(self.types) >= self.limits.max_types:
            raise ResourceLimitExceeded(
                f"the request adds a type to the {len(self.types)} this stream requested; "
                f"this server accepts at most {self.limits.max_types} per stream "
                f"(StreamLimits.max_types)")
        return type_url

    def _check_names(self, type_url: str, count: int, what: str = "subscribes to",
                     slack: int = 0) -> None:
        """Refuse a request naming more than `max_resource_names`. Checked first on the raw
        count (cheap: a hostile request is refused before any set of its names is built),
        then on the distinct names the subscription would hold."""
        limit = self.limits.max_resource_names
        if count - slack > limit:
            raise ResourceLimitExceeded(
                f"the request {what} {count} {type_name(type_url)} resource names; "
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
        detail = _error_detail(error, self.limits.fields.error_detail)
        return Nack(st.type_url, nonce, version, detail, dict(pending))

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
