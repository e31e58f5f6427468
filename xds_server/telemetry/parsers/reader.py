"""An indexed metrics page and the lookups extractors make on it, recording every rejection."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from xds_server.telemetry.reading import HistogramState, valid

Labels = Mapping[str, str]
Series = tuple[Labels, float]


class MetricsFormatError(ValueError):
    """A metrics page could not be read: not Prometheus text, or no usable signal on it
    (the exporter's fault; the endpoint is reported and goes stale, nothing else is hurt)."""


def index_page(text: str) -> dict[str, list[Series]]:
    """Every sample on the page, keyed by its exposed sample name (``_total`` kept)."""
    index: dict[str, list[Series]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                index.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except Exception as exc:  # the parser raises bare ValueError/TypeError/IndexError
        raise MetricsFormatError(f"not a Prometheus text page: {exc}") from exc
    return index


class Reader:
    """Looks signals up on an indexed page and records why any was rejected."""

    def __init__(self, index: Mapping[str, list[Series]]) -> None:
        self.index = index
        self.problems: list[str] = []

    def values(self, name: str, where: Labels | None = None) -> list[float]:
        rows = self.index.get(name, [])
        if where:
            rows = [r for r in rows if all(r[0].get(k) == v for k, v in where.items())]
        return [value for _, value in rows]

    def reject(self, signal: str, source: str, detail: str) -> None:
        self.problems.append(f"{signal}: {source} {detail}")

    def gauge(
        self,
        signal: str,
        names: Sequence[str],
        combine: Callable[[Iterable[float]], float],
        bounds: tuple[float, float] = (0.0, math.inf),
        where: Labels | None = None,
    ) -> float | None:
        """First of ``names`` present on the page, all its series combined; else ``None``."""
        for name in names:
            values = self.values(name, where)
            if not values:
                continue
            bad = [v for v in values if not valid(v, *bounds)]
            if bad:
                self.reject(signal, _label(name, where), f"is {bad[0]!r}, outside {bounds}")
                return None
            combined = combine(values)
            if not valid(combined, *bounds):
                self.reject(signal, _label(name, where), f"combines to {combined!r}")
                return None
            return combined
        return None

    def histogram(self, key: str, bases: Sequence[str]) -> HistogramState | None:
        """First histogram (or summary) of ``bases`` with both ``_sum`` and ``_count``."""
        for base in bases:
            sums, counts = self.values(f"{base}_sum"), self.values(f"{base}_count")
            if not sums or not counts:
                continue
            bad = [v for v in sums + counts if not valid(v, 0.0, math.inf)]
            if bad:
                self.reject(key, base, f"has sum/count {bad[0]!r}")
                return None
            total, count = fsum(sums), fsum(counts)
            if not (math.isfinite(total) and math.isfinite(count)):
                self.reject(key, base, "sum/count overflow")
                return None
            return HistogramState(sum=total, count=count)
        return None


def _label(name: str, where: Labels | None) -> str:
    if not where:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in where.items())
    return f"{name}{{{inner}}}"


def prefixed(stems: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    return [prefix + stem for stem in stems for prefix in prefixes]


def fsum(values: Iterable[float]) -> float:
    """Exact sum; an overflow is infinite, which validation then rejects (found by fuzzing)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf
