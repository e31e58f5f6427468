"""The snapshot cache: the only shared mutable state, and level-based.

`set_snapshot` replaces the current snapshot and wakes every stream; a stream that wakes reads
the *latest* snapshot, so a burst of updates coalesces instead of queueing intermediate states.
An inconsistent snapshot never gets here: `build_snapshot` refuses it and the caller keeps the
last good one (see `Controller.publish`).

It holds nothing per client: NACK memory lives in each stream's machine (`protocol.Rejections`)
and ends with the stream, so no client can make the cache withhold config from another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from xds_server.xds.convergence import Convergence
from xds_server.xds.snapshot import Snapshot


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshot: Snapshot | None = None
        self._watchers: set[Callable[[], None]] = set()
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
