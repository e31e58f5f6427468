"""The stream observer interface, and `Observers`, which calls several of them in turn.

Observers run on the event loop, inside the stream's pump, in the order they were given: they
must not block or await (hand slow work to a task). An exception from an observer never
reaches the stream: `Observers` logs it (the first time with its traceback, then at every
power-of-two count) and counts it in `failures`, and the other observers still run.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from xds_server.admin import metrics
from xds_server.xds.peer_text import shown
from xds_server.xds.protocol import Event, ProtocolError, Response, Withheld
from xds_server.xds.stream_info import StreamInfo

log = logging.getLogger("trimtab.xds")


class Sent(NamedTuple):
    """A response the pump has handed to gRPC (a tuple: cheap to build once per push)."""

    response: Response
    size: int  # bytes written, gRPC's 5-byte prefix not counted
    seconds: float  # to encode it and hand it to gRPC


class StreamObserver:
    """Told what happens on every stream. Each method here does nothing: override the ones
    you need (`Observers` calls only those)."""

    def on_open(self, stream: StreamInfo) -> None:
        """The stream started (before its first request is read)."""

    def on_subscribe(self, stream: StreamInfo, type_url: str) -> None:
        """The stream sent its first request for `type_url` (`stream.types` now has it)."""

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        """The machine's answer to a request: an ACK, NACK, stale nonce or subscription."""

    def on_withheld(self, stream: StreamInfo, notice: Withheld) -> None:
        """The machine did not send resources that cannot fit in one response (our fault)."""

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        """A response was written to the stream."""

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        """The peer broke the protocol; the stream is about to end with an error status."""

    def on_close(self, stream: StreamInfo) -> None:
        """The stream ended, whatever the reason."""


HOOKS = ("on_open", "on_subscribe", "on_event", "on_withheld", "on_sent", "on_error",
         "on_close")


class EventCallback(StreamObserver):
    """An `on_event(stream, event)` function as an observer."""

    def __init__(self, callback: Callable[[StreamInfo, Event], None]) -> None:
        self.callback = callback

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        self.callback(stream, event)

    def __repr__(self) -> str:
        return f"EventCallback({getattr(self.callback, '__qualname__', self.callback)!r})"


def _overrides(observer: object, hook: str) -> bool:
    """Whether `observer` has its own `hook` (not `StreamObserver`'s no-op, not missing)."""
    mine = getattr(type(observer), hook, None)
    return mine is not None and mine is not getattr(StreamObserver, hook)


def _name(observer: object) -> str:
    return repr(observer) if isinstance(observer, EventCallback) else type(observer).__name__


class Observers(StreamObserver):
    """Several observers as one: each hook calls, in order, the observers that implement it.
    A failing observer is logged and counted (`failures`, by "observer.hook") and never stops
    the others or the stream."""

    def __init__(self, observers: Iterable[StreamObserver] = ()) -> None:
        self._observers: list[StreamObserver] = []
        self._calls: dict[str, list[tuple[str, Callable[..., Any]]]] = {h: [] for h in HOOKS}
        self.failures: Counter[str] = Counter()
        for observer in observers:
            self.add(observer)

    def add(self, observer: StreamObserver) -> None:
        self._observers.append(observer)
        for hook in HOOKS:
            if _overrides(observer, hook):
                self._calls[hook].append((f"{_name(observer)}.{hook}", getattr(observer, hook)))

    @property
    def observers(self) -> list[StreamObserver]:
        return list(self._observers)

    @property
    def failed(self) -> int:
        """Observer calls that raised, all together."""
        return sum(self.failures.values())

    def _each(self, hook: str, stream: StreamInfo, *args: object) -> None:
        for name, call in self._calls[hook]:
            try:
                call(stream, *args)
            except Exception:  # noqa: BLE001 - an observer never breaks a stream
                self._failed(name, stream)

    def _failed(self, name: str, stream: StreamInfo) -> None:
        self.failures[name] += 1
        metrics.OBSERVER_FAILURES.labels(observer=name).inc()
        count = self.failures[name]
        if count == 1:
            log.exception("stream observer %s failed (stream from %s, node %s); the stream "
                          "goes on without it", name, stream.peer, shown(stream.node_id))
        elif count & (count - 1) == 0:
            log.error("stream observer %s has failed %d times (the first is logged with its "
                      "traceback); the streams go on without it", name, count)

    def on_open(self, stream: StreamInfo) -> None:
        self._each("on_open", stream)

    def on_subscribe(self, stream: StreamInfo, type_url: str) -> None:
        self._each("on_subscribe", stream, type_url)

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        self._each("on_event", stream, event)

    def on_withheld(self, stream: StreamInfo, notice: Withheld) -> None:
        self._each("on_withheld", stream, notice)

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        self._each("on_sent", stream, sent)

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        self._each("on_error", stream, error)

    def on_close(self, stream: StreamInfo) -> None:
        self._each("on_close", stream)
