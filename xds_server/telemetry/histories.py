"""Latency over a window from cumulative histogram states (``_sum`` / ``_count``)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from xds_server.telemetry.reading import HistogramState


def windowed_mean(
    history: Sequence[tuple[float, HistogramState]], now: float, window_s: float
) -> float | None:
    """Mean observation over the last ``window_s`` seconds from cumulative histogram states.

    Uses the samples with ``now - window_s <= t <= now`` (in time order): the mean is
    ``Δsum / Δcount`` between the oldest and the newest of them. If a counter went down
    between any two of them (a server restart), the newest state alone is used, since it
    counts exactly the observations since the reset. Returns ``None`` when fewer than two
    samples fall in the window (and no reset), or no new observations were made.
    """
    inside = sorted(
        ((t, s) for t, s in history if now - window_s <= t <= now), key=lambda item: item[0]
    )
    if not inside:
        return None
    newest = inside[-1][1]
    states = [s for _, s in inside]
    if any(b.count < a.count or b.sum < a.sum for a, b in zip(states, states[1:], strict=False)):
        return newest.sum / newest.count if newest.count > 0 else None
    oldest = states[0]
    d_count = newest.count - oldest.count
    if d_count <= 0:
        return None
    return (newest.sum - oldest.sum) / d_count


class HistogramHistory:
    """Bounded per-key history of :class:`HistogramState` for :func:`windowed_mean`.

    Keys are free-form (e.g. ``(address, "itl")``). Not thread-safe; use from one task.
    """

    def __init__(self, window_s: float, max_samples: int = 64) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be finite and > 0, got {window_s!r}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.window_s = window_s
        self._max = max_samples
        self._data: dict[object, deque[tuple[float, HistogramState]]] = {}

    def record(self, key: object, at: float, state: HistogramState) -> None:
        """Append one state read at time ``at``."""
        self._data.setdefault(key, deque(maxlen=self._max)).append((at, state))

    def mean(self, key: object, now: float) -> float | None:
        """:func:`windowed_mean` of ``key``'s history (``None`` if unknown)."""
        history = self._data.get(key)
        return None if history is None else windowed_mean(history, now, self.window_s)

    def forget(self, keep: Callable[[object], bool]) -> None:
        """Drop every key for which ``keep(key)`` is false."""
        for key in [k for k in self._data if not keep(k)]:
            del self._data[key]
