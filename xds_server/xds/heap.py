"""Handing freed heap memory back to the OS after streams that held many names close.

What a stream subscribed to is held by its machine only, and freed when it closes; glibc keeps
freed small blocks otherwise, and RSS would stay at its peak. `HeapTrimmer` observes stream
closes and calls `malloc_trim` once enough names were freed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable
from functools import cache

from xds_server.xds.observers.base import StreamObserver
from xds_server.xds.protocol import DeltaStream, SotwStream
from xds_server.xds.stream_info import StreamInfo

log = logging.getLogger("trimtab.xds")

TRIM_AFTER_NAMES = 10_000  # names held by streams closed since the last trim that call for one
TRIM_DELAY_S = 0.5  # closes within this long share one trim


@cache
def _load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    for name in ("libc.so.6", ctypes.util.find_library("c")):
        if name is None:
            continue
        try:
            trim = ctypes.CDLL(name).malloc_trim
        except (OSError, AttributeError):
            continue
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        return trim  # type: ignore[no-any-return]
    return None


def held_names(machine: SotwStream | DeltaStream) -> int:
    """How many names a stream's machine holds (subscribed and sent), all types together."""
    return sum(len(st.names) + len(st.sent) for st in machine.types.values())


class HeapTrimmer(StreamObserver):
    """Returns freed heap memory to the OS once streams holding at least `min_names`
    subscribed or sent names (together) have closed: at most one trim per `delay_s`, run in a
    worker thread (ctypes releases the GIL), so serving never waits for it."""

    def __init__(self, min_names: int = TRIM_AFTER_NAMES, delay_s: float = TRIM_DELAY_S,
                 trim: Callable[[int], int] | None = None) -> None:
        self.min_names = min_names
        self.delay_s = delay_s
        self.trims = 0  # completed
        self.last_seconds = 0.0  # how long the last trim took (in its worker thread)
        self._trim = trim if trim is not None else _load_malloc_trim()
        self._pending = 0
        self._timer: asyncio.TimerHandle | None = None

    def on_close(self, stream: StreamInfo) -> None:
        self.closed(held_names(stream.machine))

    def closed(self, names: int) -> None:
        """A stream that held `names` names has ended."""
        self._pending += names
        if self._trim is None or self._timer is not None or self._pending < self.min_names:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.delay_s, self._start, loop)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._pending = None, 0
        loop.run_in_executor(None, self._run).add_done_callback(self._done)

    def _run(self) -> float:
        started = time.perf_counter()
        assert self._trim is not None
        self._trim(0)
        return time.perf_counter() - started

    def _done(self, future: asyncio.Future) -> None:
        self.trims += 1
        if future.exception() is None:
            self.last_seconds = future.result()
            log.debug("returned freed heap memory to the OS in %.3f s", self.last_seconds)
