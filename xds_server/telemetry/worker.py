"""The telemetry worker: the one thread that runs telemetry CPU work (page parsing, weighing,
building snapshots), so the event loop that serves xDS, admin, health and KEDA never waits
for it (:func:`off_loop`)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
_worker: tuple[int, ThreadPoolExecutor] | None = None  # (creating pid, executor)
_worker_lock = threading.Lock()


def telemetry_worker() -> ThreadPoolExecutor:
    """The one thread that runs telemetry CPU work (page parsing, weighing) for the process.

    One thread, not a pool: pure-Python work holds the GIL, so a second worker would add no
    throughput and would make the event loop wait behind more threads for the GIL. A forked
    child gets its own (the parent's thread does not exist there)."""
    global _worker
    with _worker_lock:
        if _worker is None or _worker[0] != os.getpid():
            _worker = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="trimtab-telemetry"))
        return _worker[1]


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` on the telemetry worker thread and await its result: CPU work there never
    holds up the event loop that serves xDS, admin, health and KEDA. ``fn`` must not touch
    state that the loop mutates meanwhile (pass it what it needs).

    The cyclic garbage collector is paused while ``fn`` runs: a collection holds the GIL
    whichever thread runs it, so the loop would wait for every one that ``fn``'s allocations
    set off (several full ones per tick at 10,000 endpoints, each walking ``fn``'s
    short-lived objects too). Reference counting still frees them as ``fn`` drops them; the
    collector runs once ``fn`` is done, over what is left."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(telemetry_worker(), _without_gc, fn, args, kwargs)


def _without_gc(fn: Callable[..., T], args: tuple[object, ...], kwargs: dict[str, object]) -> T:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()
