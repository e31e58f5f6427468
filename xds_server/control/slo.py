"""SLO telemetry for canary gates: P95 TTFT, P95 ITL and error rate per version.

Model servers export cumulative histograms and counters; the page parser reads the ones the
gates need into a :class:`~xds_server.telemetry.reading.SloCounters` per read (see
:mod:`xds_server.telemetry.parsers.slo` for the names). :class:`SloTracker` keeps a short
history per endpoint and turns it into a `VersionStats` over a window: deltas per endpoint (a
counter that went down means a restart, so its newest value counts alone), summed over the
version's endpoints, and P95 by linear interpolation inside the bucket, as PromQL's
``histogram_quantile`` does. A window's requests are the finished ones plus the errors (a
failed request never finishes).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xds_server.control.rollouts.machine import VersionStats
from xds_server.telemetry.reading import SloCounters


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket counts {upper bound: count}."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower
            span = count - below
            return bound if span <= 0 else lower + (bound - lower) * (rank - below) / span
        lower, below = bound, count
    return lower


@dataclass(frozen=True)
class _Point:
    at: float
    counters: SloCounters


class SloTracker:
    """Bounded per-endpoint history of :class:`SloCounters` reads."""

    def __init__(self, max_points: int = 512) -> None:
        self._history: dict[str, deque[_Point]] = {}
        self._max = max_points

    def record(self, address: str, at: float, counters: SloCounters | None) -> None:
        if counters is not None:
            self._history.setdefault(address, deque(maxlen=self._max)).append(_Point(at, counters))

    def forget(self, keep: set[str]) -> None:
        for address in [a for a in self._history if a not in keep]:
            del self._history[address]

    def _window(self, address: str, since: float) -> SloCounters | None:
        points = self._history.get(address)
        if not points:
            return None
        start = next((p for p in points if p.at >= since), points[-1])
        return points[-1].counters.since(start.counters) if start is not points[-1] else None

    def stats(self, addresses: Iterable[str], since: float) -> VersionStats:
        totals = SloCounters()
        for address in addresses:
            window = self._window(address, since)
            if window is not None:
                totals = totals.plus(window)
        # A 5xx never finishes (no e2e observation): the requests the error rate is over are
        # the finished ones plus the failed ones, so a canary failing everything is judged.
        return VersionStats(requests=totals.requests + totals.errors, errors=totals.errors,
                            ttft_p95_s=quantile(0.95, totals.ttft),
                            itl_p95_s=quantile(0.95, totals.itl))
