"""Admin documents are built on their own thread, once per version of what they show.

:class:`AdminWorker` is one thread, apart from the event loop (which serves xDS, admin, gRPC
health and KEDA) and from the telemetry worker (which runs the tick): a large document takes
neither away from its work. :class:`BuildCache` hands every reader of a document the bytes
built for the current version of its inputs; readers that arrive while a build is running
wait for that build instead of starting their own, so N readers of one version cost one
build."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

T = TypeVar("T")

Version = tuple[object, ...]  # the objects a document is built from; compared by identity
Slot = tuple[str, str | None]  # a document, and the pool or node it is narrowed to


class AdminWorker:
    """The one thread that builds and encodes admin documents.

    ``on_build`` hooks run on that thread before each build, with the document's name (the
    tests record which thread builds what)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self.on_build: list[Callable[[str], None]] = []

    async def run(self, name: str, work: Callable[[], T]) -> T:
        """Run ``work`` on the admin thread and await its result."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="trimtab-admin")
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._call, name, work)

    def _call(self, name: str, work: Callable[[], T]) -> T:
        for hook in self.on_build:
            hook(name)
        return work()

    def close(self) -> None:
        """Stop the thread once the build it is running (if any) returns."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def same_version(a: Version | None, b: Version | None) -> bool:
    """Both name the same objects (identity, not equality: inputs are replaced, not mutated)."""
    return (a is not None and b is not None and len(a) == len(b)
            and all(x is y for x, y in zip(a, b, strict=True)))


@dataclass
class _Entry(Generic[T]):
    version: Version | None
    task: asyncio.Task[T]


class BuildCache(Generic[T]):
    """The latest build per slot (a document, or a document for one pool).

    ``get(slot, version, job)``: the build of ``version`` if there is one (running or done);
    with ``version=None`` (inputs with no version, e.g. the live streams), a running build
    of that slot, else a fresh one, dropped once done. ``job`` runs on the loop (it takes
    what the build needs from state the loop owns) and returns the work for the admin
    thread. A build that fails is not kept."""

    def __init__(self, worker: AdminWorker) -> None:
        self.worker = worker
        self._entries: dict[Slot, _Entry[T]] = {}

    async def get(self, slot: Slot, version: Version | None,
                  job: Callable[[], Awaitable[Callable[[], T]]]) -> T:
        entry = self._entries.get(slot)
        if entry is None or not self._reusable(entry, version):
            entry = _Entry(version, asyncio.ensure_future(self._build(slot, job)))
            self._entries[slot] = entry
            if version is None:  # nothing to reuse it for once it is done
                entry.task.add_done_callback(partial(self._drop, slot, entry))
        return await asyncio.shield(entry.task)  # a reader that leaves cancels no build

    async def _build(self, slot: Slot, job: Callable[[], Awaitable[Callable[[], T]]]) -> T:
        work = await job()
        return await self.worker.run(slot[0], work)

    def _drop(self, slot: Slot, entry: _Entry[T], _: object) -> None:
        if self._entries.get(slot) is entry:
            del self._entries[slot]

    @staticmethod
    def _reusable(entry: _Entry[T], version: Version | None) -> bool:
        if entry.task.done() and (entry.task.cancelled() or entry.task.exception() is not None):
            return False
        if version is None:
            return not entry.task.done()
        return same_version(entry.version, version)

    def forget(self, keep: Callable[[Slot], bool]) -> None:
        """Drop the slots ``keep`` refuses (e.g. pools no longer configured)."""
        for slot in [s for s in self._entries if not keep(s)]:
            del self._entries[slot]
