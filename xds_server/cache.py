"""The snapshot cache: the only shared mutable state, and level-based.

`set_snapshot` replaces the current snapshot and wakes every stream; a stream that wakes reads
the *latest* snapshot, so a burst of updates coalesces instead of queueing intermediate states.
An inconsistent snapshot never gets here: `build_snapshot` refuses it and the caller keeps the
last good one (see `Controller.publish`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable

from .convergence import Convergence
from .protocol import Rejections
from .snapshot import Snapshot

MAX_REJECTION_NODES = 10_000  # node ids whose NACK memory outlives their streams


class SnapshotCache:
    def __init__(self, max_rejection_nodes: int = MAX_REJECTION_NODES) -> None:
        self._snapshot: Snapshot | None = None
        self._watchers: set[Callable[[], None]] = set()
        self.max_rejection_nodes = max_rejection_nodes
        self._rejections: OrderedDict[str, Rejections] = OrderedDict()  # LRU: kept alive
        self._live_rejections: weakref.WeakValueDictionary[str, Rejections] = (
            weakref.WeakValueDictionary())  # every one a stream still holds
        self.convergence = Convergence()  # stamps of EDS versions, for the ACK delay histogram
        self.generation = 0

    @property
    def snapshot(self) -> Snapshot | None:
        return self._snapshot

    def set_snapshot(self, snapshot: Snapshot, read_at: float | None = None) -> bool:
        """Publish `snapshot`. Returns False (and wakes nobody) when nothing changed.
        `read_at` (monotonic) is when the telemetry behind it was read: the changed EDS
        resources are stamped with it for the convergence histogram."""
        if self._snapshot is not None and snapshot.version == self._snapshot.version:
            return False
        self._snapshot = snapshot.reusing(self._snapshot)
        self.convergence.published(self._snapshot, read_at)
        self.generation += 1
        for wake in list(self._watchers):
            wake()
        return True

    def watch(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` on every new snapshot. Returns the function that stops watching."""
        self._watchers.add(wake)
        return lambda: self._watchers.discard(wake)

    def watch_event(self, event: asyncio.Event) -> Callable[[], None]:
        return self.watch(event.set)

    @property
    def stream_count(self) -> int:
        return len(self._watchers)

    def rejections_for(self, node_id: str) -> Rejections:
        """NACK memory per node id, kept across that node's reconnects.

        Every stream of a node gets the same object while any of them holds it. Once none
        does, it is kept for the `max_rejection_nodes` most recently seen node ids only: a node
        id seen longer ago starts afresh (and may be sent a version it once rejected)."""
        memory = self._rejections.get(node_id)
        if memory is None:
            memory = self._live_rejections.get(node_id)
            if memory is None:
                memory = self._live_rejections[node_id] = Rejections()
            self._rejections[node_id] = memory
        self._rejections.move_to_end(node_id)
        while len(self._rejections) > self.max_rejection_nodes:
            self._rejections.popitem(last=False)
        return memory

    @property
    def rejection_nodes(self) -> int:
        """How many node ids' NACK memory is kept (at most `max_rejection_nodes`)."""
        return len(self._rejections)
