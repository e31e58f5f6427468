"""A bounded, in-memory history of the weights trimtab held, for the status page's charts.

One point per tick: `(at, {pool: {address: weight}})`, plus which endpoints were stale then
(the chart marks those stretches). The oldest points fall off once
`max_points` are held (300 = 10 minutes at the default 2 s tick). Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_WINDOW_SECONDS = 600.0
DEFAULT_MAX_POINTS = 300

PoolWeightMap = dict[str, dict[str, int]]  # pool -> address -> weight
PoolStaleMap = dict[str, list[str]]  # pool -> its stale addresses (pools with none left out)


@dataclass(frozen=True)
class HistoryPoint:
    at: float  # the controller clock (unix seconds) when the weights were recorded
    weights: PoolWeightMap
    stale: PoolStaleMap


class WeightHistory:
    """A ring buffer of weight points. `record` after each tick; `document` for `/v1/history`."""

    def __init__(self, max_points: int = DEFAULT_MAX_POINTS) -> None:
        if max_points < 1:
            raise ValueError(f"max_points must be >= 1, got {max_points}")
        self.max_points = max_points
        self._points: deque[HistoryPoint] = deque(maxlen=max_points)

    @classmethod
    def for_interval(cls, interval_seconds: float,
                     window_seconds: float = DEFAULT_WINDOW_SECONDS) -> WeightHistory:
        """Enough points to cover `window_seconds` at one point per tick."""
        return cls(max(1, math.ceil(window_seconds / interval_seconds)))

    def resize(self, max_points: int) -> None:
        """Hold at most ``max_points`` from now on (the newest are kept)."""
        if max_points < 1:
            raise ValueError(f"max_points must be >= 1, got {max_points}")
        if max_points != self.max_points:
            self.max_points = max_points
            self._points = deque(self._points, maxlen=max_points)

    def __len__(self) -> int:
        return len(self._points)

    def record(self, at: float, weights_doc: Mapping[str, Any]) -> None:
        """Add a point from a `/v1/weights` document (`{"pools": {pool: {address: {"weight"}}}}`)."""
        self.add(history_point(at, weights_doc))

    def add(self, point: HistoryPoint) -> None:
        """Add a point made by :func:`history_point` (e.g. on the telemetry worker).

        A point at the same time as the last one replaces it; a clock that stepped backwards
        restarts the history (points stay ordered, so `since` queries stay correct)."""
        if self._points and point.at <= self._points[-1].at:
            if point.at < self._points[-1].at:
                self._points.clear()
            else:
                self._points.pop()
        self._points.append(point)

    def document(self, since: float | None = None) -> dict[str, Any]:
        """The points recorded strictly after `since` (all when None), oldest first."""
        points = [p for p in self._points if since is None or p.at > since]
        return {
            "max_points": self.max_points,
            "oldest_at": self._points[0].at if self._points else None,
            "latest_at": self._points[-1].at if self._points else None,
            "points": [{"at": p.at, "weights": p.weights, "stale": p.stale} for p in points],
        }


def history_point(at: float, weights_doc: Mapping[str, Any]) -> HistoryPoint:
    """The point of a `/v1/weights` document: its maps hold only str and int, which the
    cyclic GC does not track (the document itself can be dropped where it was made)."""
    return HistoryPoint(float(at), *_weights_of(weights_doc))


def _weights_of(weights_doc: Mapping[str, Any]) -> tuple[PoolWeightMap, PoolStaleMap]:
    pools: Mapping[str, Mapping[str, Mapping[str, Any]]] = weights_doc.get("pools", {})
    weights = {pool: {address: int(endpoint["weight"]) for address, endpoint in endpoints.items()}
               for pool, endpoints in pools.items()}
    stale = {pool: sorted(a for a, endpoint in endpoints.items() if endpoint.get("stale"))
             for pool, endpoints in pools.items()}
    return weights, {pool: addresses for pool, addresses in stale.items() if addresses}
