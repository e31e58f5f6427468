"""The event-loop side every discovery watcher shares: a watch thread hands the latest
endpoint set over (coalesced), and the loop publishes it, sets ``changed`` and calls
``on_change``. The watcher class declares the fields used here (``changed``, ``on_change``,
``_current``, ``_synced``, ``_latest``, ``_pending``, ``_lock``, ``_stop``) and ``kind``,
its name in log lines."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

log = logging.getLogger("trimtab.discovery")


class LoopHandover:
    kind: ClassVar[str] = "discovery"
    changed: asyncio.Event
    on_change: Callable[[Any], None] | None
    _current: Any
    _synced: bool
    _latest: Any
    _pending: bool
    _lock: threading.Lock
    _stop: threading.Event

    def stop(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    @property
    def synced(self) -> bool:
        """True once the first complete set has been published."""
        return self._synced

    def current(self) -> Any:
        """The latest routable endpoint set (empty until the first one)."""
        return self._current

    async def aclose(self) -> None:
        await asyncio.to_thread(self.stop)

    async def wait_synced(self, timeout: float | None = None) -> Any:
        """Wait until the first complete set has been published; returns the current set."""
        async with asyncio.timeout(timeout):
            while not self._synced:
                self.changed.clear()
                await self.changed.wait()
        return self._current

    def _deliver(self) -> None:
        """On the loop: publish the latest set handed over by a watch thread."""
        with self._lock:
            latest, self._latest, self._pending = self._latest, None, False
        if latest is None or self._stop.is_set():
            return
        self._current, self._synced = latest, True
        self.changed.set()
        if self.on_change is not None:
            try:
                self.on_change(latest)
            except Exception:
                log.exception("%s on_change callback failed", self.kind)
