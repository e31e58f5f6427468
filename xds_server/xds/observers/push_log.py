"""The push log. Each push gets one info line while at most `PER_PUSH_LOG_STREAMS` streams are
open; above that, per-push lines go to debug and info summarises the pushes per (type, API)
once per window (1 s), so 1,000 streams make a handful of lines per tick, not 1,000."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from xds_server.xds.observers.base import Sent, StreamObserver
from xds_server.xds.peer_text import shown, type_name
from xds_server.xds.protocol import Response
from xds_server.xds.stream_info import StreamInfo

log = logging.getLogger("trimtab.xds")

PER_PUSH_LOG_STREAMS = 64  # above this many open streams, pushes are logged in summary


@dataclass
class _PushTally:
    responses: int = 0
    resources: int = 0
    removed: int = 0
    bytes: int = 0
    versions: set[str] = field(default_factory=set)


class PushLog(StreamObserver):
    """Logs every push while few streams are open; above `PER_PUSH_LOG_STREAMS`, one info
    line per (type, API) per window summing its pushes."""

    MAX_VERSIONS = 3  # versions named per line

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self.open_streams = 0
        self._tallies: dict[tuple[str, str], _PushTally] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def on_open(self, stream: StreamInfo) -> None:
        self.open_streams += 1

    def on_close(self, stream: StreamInfo) -> None:
        self.open_streams -= 1

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        response, kind = sent.response, type_name(sent.response.type_url)
        few = self.open_streams <= PER_PUSH_LOG_STREAMS
        level = logging.INFO if few else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "push %s v%s nonce %s to %s: %d resources, %d removed", kind,
                    response.version, response.nonce, shown(stream.node_id),
                    len(response.resources),
                    len(response.removed))
        if not few and log.isEnabledFor(logging.INFO):
            self.add(kind, stream.api, response, sent.size)

    def add(self, kind: str, api: str, response: Response, size: int) -> None:
        tally = self._tallies.get((kind, api))
        if tally is None:
            tally = self._tallies[(kind, api)] = _PushTally()
        tally.responses += 1
        tally.resources += len(response.resources)
        tally.removed += len(response.removed)
        tally.bytes += size
        if len(tally.versions) <= self.MAX_VERSIONS:
            tally.versions.add(response.version)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # first push, or a new event loop: the old timer is gone
            self._loop, self._timer = loop, None
        if self._timer is None:
            self._timer = loop.call_later(self.window_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for (kind, api), tally in sorted(self._tallies.items()):
            versions = sorted(tally.versions)[:self.MAX_VERSIONS]
            more = " and more" if len(tally.versions) > self.MAX_VERSIONS else ""
            log.info("pushed %s (%s) %d times within %.1f s: %d resources, %d removed, "
                     "%d bytes; versions %s%s", kind, api, tally.responses, self.window_s,
                     tally.resources, tally.removed, tally.bytes, ", ".join(versions), more)
        self._tallies.clear()
