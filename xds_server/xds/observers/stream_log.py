"""The stream log lines other than pushes: NACKs (the client's rejection, with its detail),
pushes withheld as too large (our error, once however many streams hit it) and protocol
errors (the peer's, ending its stream). Peer-supplied text (node ids, NACK details) appears
escaped and cut (`peer_text.shown`): one line per event, bounded whatever the peer sent.
Protocol errors' messages are the machines' own (sizes and bounds, never a peer's string
unescaped)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping

from xds_server.xds import type_urls
from xds_server.xds.observers.base import StreamObserver
from xds_server.xds.peer_text import shown
from xds_server.xds.protocol import Event, Nack, ProtocolError, ResourceLimitExceeded, Withheld
from xds_server.xds.stream_info import StreamInfo

log = logging.getLogger("trimtab.xds")

WITHHELD_LOGGED = 1024  # (type, version, names) withheld notices remembered, to log each once
NACK_DETAIL_LOGGED = 2000  # characters of a NACK's error detail in its log line
REJECTED_LOGGED = 5  # rejected resources named in a NACK's log line


def _identities(stream: StreamInfo) -> str:
    identities = stream.identities
    if not identities:
        return "none"
    more = f" and {len(identities) - 2} more" if len(identities) > 2 else ""
    return ", ".join(shown(identity, 128) for identity in identities[:2]) + more


def _rejected(rejected: Mapping[str, str]) -> str:
    """The first `REJECTED_LOGGED` rejected resources (name: version), and how many more."""
    items = list(itertools.islice(rejected.items(), REJECTED_LOGGED))
    named = ", ".join(f"{shown(name, 128)}: {shown(version, 64)}" for name, version in items)
    more = f" and {len(rejected) - len(items)} more" if len(rejected) > len(items) else ""
    return "{" + named + "}" + more


class StreamLog(StreamObserver):
    """Logs NACKs, withheld pushes (each once) and protocol errors."""

    def __init__(self) -> None:
        self._withheld_logged: dict[tuple[str, str, str, int], None] = {}

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        if not isinstance(event, Nack):
            return
        log.warning("NACK from node %s (peer %s, identity %s) for %s nonce %s (rejected %s): "
                    "%s", shown(stream.node_id), stream.peer, _identities(stream),
                    type_urls.short_name(event.type_url), event.nonce,
                    _rejected(event.rejected), shown(event.detail, NACK_DETAIL_LOGGED))

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        what = ("ending stream from" if isinstance(error, ResourceLimitExceeded)
                else "protocol error from")
        log.warning("%s %s (node %s): %s", what, stream.peer, shown(stream.node_id), error)

    def on_withheld(self, stream: StreamInfo, notice: Withheld) -> None:
        """Our error, logged once per (type, version, names) however many streams hit it."""
        key = (notice.type_url, notice.version, notice.names[0] if notice.names else "",
               len(notice.names))
        if key in self._withheld_logged:
            return
        self._withheld_logged[key] = None
        while len(self._withheld_logged) > WITHHELD_LOGGED:
            del self._withheld_logged[next(iter(self._withheld_logged))]
        names = ", ".join(notice.names[:5]) + (" and more" if len(notice.names) > 5 else "")
        log.error("not sending %s %s (version %s) to %s (logged once for every stream): it "
                  "needs %d bytes, above the %d one response may carry (xds.limits.max_response_bytes "
                  "less headroom; %s); raise it, and the client's receive limit where it has "
                  "one (Envoy: the ADS cluster's envoy_grpc.max_receive_message_length)",
                  type_urls.short_name(notice.type_url), names, notice.version,
                  shown(stream.node_id),
                  notice.size, notice.limit,
                  "a whole-state type cannot be split" if len(notice.names) > 1
                  else "one resource cannot be split")
