"""What a weighing leaves behind besides the weights: a log line when an endpoint goes stale
or recovers and when its rejected inputs change, the per-endpoint flags the admin API shows
(``TickStats.stale`` / ``problems``), and the telemetry-errors counter. The telemetry worker
writes them while the loop may forget clusters a new config dropped: both go through
:attr:`WeighingNotes.lock`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from weight_calculator.types import PoolWeights
from xds_server.admin import metrics
from xds_server.telemetry.scrape import ScrapeResult

log = logging.getLogger("trimtab.controller")


@dataclass
class TickStats:
    ticks: int = 0
    published: int = 0
    rejected: int = 0
    last_tick_at: float | None = None
    last_error: str | None = None
    stale: dict[str, bool] = field(default_factory=dict)  # "pool/address" -> stale
    problems: dict[str, tuple[str, ...]] = field(default_factory=dict)  # flagged endpoints


class WeighingNotes:
    def __init__(self, stats: TickStats) -> None:
        self.stats = stats
        self.lock = threading.Lock()  # one weighing's notes at a time, or one forget
        self._error_series: set[str] = set()  # clusters with a telemetry-errors series

    def note_pool(self, pool: str, weights: PoolWeights, results: Mapping[str, ScrapeResult]
                  ) -> None:
        """Logs and stats of one cluster's weighing (its gauges are rendered at scrape
        time). The caller holds :attr:`lock`."""
        for address, ew in weights.endpoints.items():
            key = f"{pool}/{address}"
            if self.stats.stale.get(key, False) != ew.stale:
                error = results[address].error if address in results else None
                log.log(logging.WARNING if ew.stale else logging.INFO,
                        "endpoint %s telemetry %s%s", key, "stale" if ew.stale else "recovered",
                        f": {error}" if ew.stale and error else "")
            self.stats.stale[key] = ew.stale
            self._note_problems(key, ew.problems)
            read = results.get(address)
            if read is not None and (read.error or read.problems):
                metrics.SCRAPE_ERRORS.labels(pool=pool).inc()
                self._error_series.add(pool)

    def _note_problems(self, key: str, problems: tuple[str, ...]) -> None:
        """Log an endpoint's rejected inputs once per change (and once when they clear)."""
        if self.stats.problems.get(key, ()) == problems:
            return
        if problems:
            log.warning("endpoint %s telemetry input problems: %s", key, "; ".join(problems))
            self.stats.problems[key] = problems
        else:
            log.info("endpoint %s telemetry input problems cleared", key)
            del self.stats.problems[key]

    def forget(self, members: Mapping[str, set[str]]) -> None:
        """Drop the flags of endpoints and the telemetry-errors series of clusters no longer
        configured (``members``: cluster -> its addresses). The per-endpoint gauges need
        nothing: admin.metrics.FleetCollector renders them from the weights."""
        with self.lock:
            for cluster in [c for c in self._error_series if c not in members]:
                metrics.SCRAPE_ERRORS.remove(cluster)
                self._error_series.discard(cluster)
            keys = {f"{cluster}/{address}" for cluster, addresses in members.items()
                    for address in addresses}
            for table in (self.stats.stale, self.stats.problems):
                for key in [k for k in table if k not in keys]:
                    del table[key]
