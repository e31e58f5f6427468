"""The latest observation per endpoint (:class:`TelemetryStore`): the last good signals, held
for ``stale_after_seconds`` when a read fails or a signal is rejected, kept as plain tuples
and float maps the cyclic garbage collector does not track (issue 13: its pauses stall the
loop in proportion to the tracked objects alive)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from weight_calculator.types import Observation, Sample
from xds_server.telemetry.scrape import ScrapeResult

LOAD_SIGNALS = ("kv_usage", "gpu_mem_pct", "queue", "itl_ms")
_REJECTED_AS = {"itl": "itl_ms"}  # the ITL histogram feeds itl_ms


def rejected_load_signals(problems: Iterable[str], signals: Mapping[str, float]
                          ) -> tuple[str, ...]:
    """Load signals named by ``problems`` (``"<signal>: ..."``) and absent from ``signals``."""
    found: list[str] = []
    for line in problems:
        head = line.split(":", 1)[0].strip()
        name = _REJECTED_AS.get(head, head)
        if name in LOAD_SIGNALS and name not in signals and name not in found:
            if name == "itl_ms" and "itl_sum" in signals:
                continue
            found.append(name)
    return tuple(found)


# One endpoint's latest state in the store, as a tuple of atomic values and tuples of them:
# (collected_at, signals as (name, value) pairs, problems, saturated) of the last good sample
# (None, None, (), () when there is none), then the latest error and failures in a row. The
# cyclic GC untracks such a tuple (not one that holds a dict, even an untracked one), so
# 10,000 endpoints add nothing to what each full collection walks; an Observation and its
# Sample would be two tracked objects per endpoint.
Row = tuple[float | None, tuple[tuple[str, float], ...] | None, tuple[str, ...], tuple[str, ...],
            str | None, int]
_NO_ROW: Row = (None, None, (), (), None, 0)


@dataclass(frozen=True)
class ObservationRows:
    """The store's rows for some addresses, copied on the loop (immutable rows, new dicts):
    :meth:`observations` builds the :class:`Observation` objects where they are used."""

    rows: dict[str, Row]
    first_seen: dict[str, float]

    def observations(self) -> dict[str, Observation]:
        return {a: _observation(row, self.first_seen.get(a)) for a, row in self.rows.items()}


def _observation(row: Row, first_seen: float | None) -> Observation:
    at, signals, problems, saturated, error, failures = row
    sample = None if at is None or signals is None else Sample(at, dict(signals), problems,
                                                               saturated)
    return Observation(sample, error, first_seen, failures)


class TelemetryStore:
    """The latest :class:`Observation` per endpoint address, and when each was first seen.

    A load signal that a read rejects (NaN, negative, out of range: named in its problems)
    keeps its last good value for up to ``hold_seconds``, then counts as saturated (in
    ``Sample.saturated``) until a read carries it valid again. A signal a server never
    reports is simply absent (the policy renormalises over the rest). Everything is kept in
    forms the cyclic GC does not track (see :data:`Row`).
    """

    def __init__(self, hold_seconds: float = 6.0) -> None:
        self.hold_seconds = hold_seconds
        self._rows: dict[str, Row] = {}
        self._first_seen: dict[str, float] = {}
        # Per address, per load signal: when it was last good, and its value (None for an ITL
        # that a histogram carries). Two dicts of atomic values, not (at, value) tuples: a
        # dict that takes in a fresh tuple is tracked again.
        self._good_at: dict[str, dict[str, float]] = {}
        self._good_value: dict[str, dict[str, float | None]] = {}

    def record(self, address: str, result: ScrapeResult) -> None:
        """Success replaces the sample; failure keeps the last good sample and sets error."""
        self._first_seen.setdefault(address, result.collected_at)
        if result.error is None and result.signals is not None:
            self._rows[address] = self._sample(address, result)
            return
        error = result.error if result.error is not None else "scrape: no signals"
        at, signals, problems, saturated, _, failures = self._rows.get(address, _NO_ROW)
        self._rows[address] = (at, signals, problems, saturated, error, failures + 1)

    def _sample(self, address: str, result: ScrapeResult) -> Row:
        """The read's sample: its signals, a rejected load signal held or marked saturated."""
        signals = dict(result.signals or {})
        at = result.collected_at
        good_at = self._good_at.setdefault(address, {})
        good_value = self._good_value.setdefault(address, {})
        for name in LOAD_SIGNALS:
            if name in signals:
                good_at[name], good_value[name] = at, signals[name]
            elif name == "itl_ms" and "itl_sum" in signals:
                good_at[name], good_value[name] = at, None  # the latency window has it
        problems = list(result.problems)
        saturated: list[str] = []
        for name in rejected_load_signals(result.problems, signals):
            last_at = good_at.get(name)
            if last_at is not None and at - last_at <= self.hold_seconds:
                last = good_value[name]
                if last is not None:
                    signals[name] = last
                problems.append(f"{name}: holding the last good value for at most "
                                f"{self.hold_seconds:g}s")
            else:
                saturated.append(name)
                problems.append(f"{name}: counted as saturated until it is valid again")
        return (at, tuple(signals.items()), tuple(problems), tuple(saturated), None, 0)

    def seen(self, addresses: Iterable[str], at: float) -> None:
        """Note ``at`` as the first-seen time of every address not seen before."""
        for address in addresses:
            self._first_seen.setdefault(address, at)

    def rows(self, addresses: Iterable[str]) -> ObservationRows:
        """A copy of what the store holds for ``addresses``, cheap to take on the loop."""
        rows, first_seen = self._rows, self._first_seen
        wanted = list(addresses)
        return ObservationRows({a: rows.get(a, _NO_ROW) for a in wanted},
                               {a: first_seen[a] for a in wanted if a in first_seen})

    def observations(self, addresses: Iterable[str]) -> dict[str, Observation]:
        """Observations for ``addresses`` (never-read ones get ``Observation(None)``, with
        their first-seen time when :meth:`seen` noted one)."""
        return self.rows(addresses).observations()

    def forget(self, keep: set[str]) -> None:
        """Drop every endpoint not in ``keep``."""
        for table in (self._rows, self._first_seen, self._good_at, self._good_value):
            for address in [a for a in table if a not in keep]:
                del table[address]
