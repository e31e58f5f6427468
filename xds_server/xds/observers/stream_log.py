"""The stream log lines other than pushes: NACKs (the client's rejection, with its detail),
pushes withheld as too large (our error, once however many streams hit it) and protocol
errors (the peer's, ending its stream)."""

from __future__ import annotations

import logging

from xds_server.xds import type_urls
from xds_server.xds.observers.base import StreamObserver
from xds_server.xds.protocol import Event, Nack, ProtocolError, ResourceLimitExceeded, Withheld
from xds_server.xds.stream_info import StreamInfo

log = logging.getLogger("trimtab.xds")

WITHHELD_LOGGED = 1024  # (type, version, names) withheld notices remembered, to log each once
NACK_DETAIL_LOGGED = 2000  # characters of a NACK's error detail in its log line


class StreamLog(StreamObserver):
    """Logs NACKs, withheld pushes (each once) and protocol errors."""

    def __init__(self) -> None:
        self._withheld_logged: dict[tuple[str, str, str, int], None] = {}

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        if not isinstance(event, Nack):
            return
        log.warning("NACK from node %r (peer %s, identity %s) for %s nonce %s (rejected %s): "
                    "%s", stream.node_id, stream.peer, stream.identities or "none",
                    type_urls.short_name(event.type_url), event.nonce, dict(event.rejected),
                    event.detail[:NACK_DETAIL_LOGGED])

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        what = ("ending stream from" if isinstance(error, ResourceLimitExceeded)
                else "protocol error from")
        log.warning("%s %s (node %r): %s", what, stream.peer, stream.node_id, error)

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
        log.error("not sending %s %s (version %s) to %r (logged once for every stream): it "
                  "needs %d bytes, above the %d one response may carry (xds.limits.max_response_bytes "
                  "less headroom; %s); raise it, and the client's receive limit where it has "
                  "one (Envoy: the ADS cluster's envoy_grpc.max_receive_message_length)",
                  type_urls.short_name(notice.type_url), names, notice.version, stream.node_id,
                  notice.size, notice.limit,
                  "a whole-state type cannot be split" if len(notice.names) > 1
                  else "one resource cannot be split")
