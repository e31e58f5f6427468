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

from xds_server.admin.encoding import dumps, join_array, join_object, within_budget

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

    def points(self, since: float | None = None) -> list[HistoryPoint]:
        """The points recorded strictly after `since` (all when None), oldest first."""
        return [p for p in self._points if since is None or p.at > since]

    def span(self) -> HistorySpan:
        """What the document says of the whole history, whatever `since` asked for."""
        return HistorySpan(self.max_points, self._points[0].at if self._points else None,
                           self._points[-1].at if self._points else None)

    def document(self, since: float | None = None) -> dict[str, Any]:
        """The points recorded strictly after `since` (all when None), oldest first."""
        return {**self.span().document(),
                "points": [point_document(p) for p in self.points(since)]}


@dataclass(frozen=True)
class HistorySpan:
    max_points: int
    oldest_at: float | None
    latest_at: float | None

    def document(self) -> dict[str, Any]:
        return {"max_points": self.max_points, "oldest_at": self.oldest_at,
                "latest_at": self.latest_at}


def point_document(point: HistoryPoint) -> dict[str, Any]:
    return {"at": point.at, "weights": point.weights, "stale": point.stale}


class HistoryEncoder:
    """`/v1/history` as bytes within a byte limit: each point is encoded once (points never
    change) and the newest that fit are sent; ``left_out`` (present only then) counts the
    older ones asked for but not sent. Not thread-safe: one thread (the admin thread) uses it."""

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[HistoryPoint, bytes]] = {}

    def encode(self, span: HistorySpan, points: list[HistoryPoint], limit: int) -> bytes:
        fragments = [self._fragment(p) for p in points]
        self._forget(span)
        fits = within_budget(fragments[::-1], max(0, limit - 512))
        kept = fits.kept[::-1]
        parts = [(key, dumps(value)) for key, value in span.document().items()]
        if fits.left_out:  # only then: the document keeps its shape otherwise
            parts.append(("left_out", dumps(fits.left_out)))
            parts.append(("left_out_hint", dumps(
                f"{fits.left_out} older points left out to stay within the document's "
                f"byte limit; ask for later ones with ?since=")))
        return join_object(sorted([*parts, ("points", join_array(kept))]))

    def _forget(self, span: HistorySpan) -> None:
        """Drop the points that fell off the ring (older than its oldest), and the oldest
        beyond twice its size (a history restarted by a clock step)."""
        held = sorted(self._encoded.items(), key=lambda item: item[1][0].at)
        keep = [(key, value) for key, value in held
                if span.oldest_at is not None and value[0].at >= span.oldest_at]
        self._encoded = dict(keep[-2 * span.max_points:])

    def _fragment(self, point: HistoryPoint) -> bytes:
        held = self._encoded.get(id(point))
        if held is None or held[0] is not point:
            held = self._encoded[id(point)] = (point, dumps(point_document(point)))
        return held[1]


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
