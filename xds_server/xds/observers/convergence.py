"""Convergence per stream: which stamped EDS versions each response carried, and the delay
from their telemetry read to the client's ACK (`xds.convergence`, `trimtab_convergence_seconds`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from xds_server.xds.convergence import Convergence, StreamConvergence
from xds_server.xds.observers.base import Sent, StreamObserver
from xds_server.xds.protocol import Ack, Event, Nack
from xds_server.xds.stream_info import StreamInfo


class ConvergenceObserver(StreamObserver):
    """One `StreamConvergence` per open stream, fed its EDS responses, ACKs and NACKs."""

    def __init__(self, tracker: Convergence,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tracker = tracker
        self.clock = clock  # the clock `Convergence` stamps are read on
        self.streams: dict[StreamInfo, StreamConvergence] = {}

    def on_open(self, stream: StreamInfo) -> None:
        self.streams[stream] = StreamConvergence(self.tracker, stream.api)

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        tracked = self.streams.get(stream)
        if tracked is not None:
            response = sent.response
            tracked.sent(response.type_url, response.nonce, response.resources)

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        tracked = self.streams.get(stream)
        if tracked is None:
            return
        if isinstance(event, Ack):
            tracked.acked(event.type_url, event.nonce, self.clock())
        elif isinstance(event, Nack):
            tracked.nacked(event.nonce)

    def on_close(self, stream: StreamInfo) -> None:
        self.streams.pop(stream, None)
