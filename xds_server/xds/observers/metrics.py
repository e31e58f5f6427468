"""The stream and push metrics (docs/metrics.md): open streams, the types they requested,
responses pushed (count, resources, bytes, time to encode and write), ACKs, NACKs, stale
nonces and protocol errors. Per push, the labelled children are looked up once per
(type, API), not once per metric."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from xds_server.admin import metrics
from xds_server.xds import type_urls
from xds_server.xds.observers.base import Sent, StreamObserver
from xds_server.xds.protocol import Ack, Event, Nack, ProtocolError, StaleNonce
from xds_server.xds.stream_info import StreamInfo


@dataclass(frozen=True)
class _PushMetrics:
    """The push metrics' labelled children for one (type, API)."""

    pushes: Any
    resources: Any
    bytes: Any
    seconds: Any


@lru_cache(maxsize=64)
def _push_metrics(kind: str, api: str) -> _PushMetrics:
    return _PushMetrics(metrics.PUSHES.labels(type=kind, api=api),
                        metrics.PUSH_RESOURCES.labels(type=kind),
                        metrics.PUSH_BYTES.labels(type=kind),
                        metrics.PUSH_SECONDS.labels(type=kind))


def _label(type_url: str) -> str:
    """The `type` label: the short name of a type this server serves, else "other" (a peer
    may request any type URL; each new label would be a new series kept for good)."""
    return type_urls.SHORT_NAMES.get(type_url, "other")


_EVENT_COUNTERS = ((Ack, metrics.ACKS), (Nack, metrics.NACKS), (StaleNonce, metrics.STALE_NONCES))


class StreamMetrics(StreamObserver):
    """Keeps the `trimtab_xds_*` stream metrics."""

    def on_open(self, stream: StreamInfo) -> None:
        metrics.STREAMS.labels(api=stream.api).inc()

    def on_subscribe(self, stream: StreamInfo, type_url: str) -> None:
        metrics.SUBSCRIPTIONS.labels(type=_label(type_url), api=stream.api).inc()

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        for kind, counter in _EVENT_COUNTERS:
            if isinstance(event, kind):
                counter.labels(type=_label(event.type_url)).inc()
                return

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        bound = _push_metrics(_label(sent.response.type_url), stream.api)
        bound.pushes.inc()
        bound.resources.inc(len(sent.response.resources))
        bound.bytes.inc(sent.size)
        bound.seconds.observe(sent.seconds)

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        metrics.PROTOCOL_ERRORS.labels(api=stream.api).inc()

    def on_close(self, stream: StreamInfo) -> None:
        metrics.STREAMS.labels(api=stream.api).dec()
        for type_url in stream.types:
            metrics.SUBSCRIPTIONS.labels(type=_label(type_url),
                                         api=stream.api).dec()
