"""SLO telemetry for canary gates: P95 TTFT, P95 ITL and error rate per version.

Model servers export cumulative histograms and counters. `parse_slo` reads the ones the gates
need from a metrics page (prometheus_client's parser) into flat ``slo:*`` keys; `SloTracker`
keeps a short history per endpoint and turns it into a `VersionStats` over a window: deltas per
endpoint (a counter that went down means a restart, so its newest value counts alone), summed
over the version's endpoints, and P95 by linear interpolation inside the bucket, as PromQL's
``histogram_quantile`` does.

Names read: vLLM ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
(older ``vllm:time_per_output_token_seconds``), ``vllm:e2e_request_latency_seconds_count``
(finished requests), and the API server's ``http_requests_total{status="5xx"|...}``
(prometheus-fastapi-instrumentator, which vLLM uses) for errors; a window's requests are the
finished ones plus the errors (a failed request never finishes). SGLang
``sglang:time_to_first_token_seconds`` / ``sglang:inter_token_latency_seconds``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from xds_server.control.rollouts.machine import VersionStats

PREFIX = "slo:"
_TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
        "sglang:inter_token_latency_seconds")
_FINISHED = ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds")


def _buckets(family_samples: Iterable, into: dict[str, float], key: str) -> None:
    for sample in family_samples:
        if sample.name.endswith("_bucket") and "le" in sample.labels:
            bound = sample.labels["le"]
            into[f"{PREFIX}{key}:{bound}"] = into.get(f"{PREFIX}{key}:{bound}", 0.0) + sample.value


def _counters(family, into: dict[str, float]) -> None:
    if family.name in _FINISHED:
        for sample in family.samples:
            if sample.name.endswith("_count"):
                into[f"{PREFIX}requests"] = into.get(f"{PREFIX}requests", 0.0) + sample.value
    elif family.name == "http_requests":
        for sample in family.samples:
            if sample.name.endswith("_total") and str(sample.labels.get("status", "")).startswith("5"):
                into[f"{PREFIX}errors"] = into.get(f"{PREFIX}errors", 0.0) + sample.value


def parse_slo(text: str) -> dict[str, float]:
    """The ``slo:*`` keys of one page; empty when the page has none. Never raises on
    content the gates don't use; a page that does not parse at all yields nothing."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except Exception:  # noqa: BLE001 - the weight parser reports malformed pages
        return {}
    seen_itl = False
    for family in families:
        if family.name in _TTFT:
            _buckets(family.samples, out, "ttft")
        elif family.name in _ITL and not seen_itl:
            _buckets(family.samples, out, "itl")
            seen_itl = True
        _counters(family, out)
    return {k: v for k, v in out.items() if math.isfinite(v) and v >= 0}


def split_signals(signals: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """(weight signals, slo signals) of a parsed page."""
    plain = {k: v for k, v in signals.items() if not k.startswith(PREFIX)}
    slo = {k: v for k, v in signals.items() if k.startswith(PREFIX)}
    return plain, slo


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
    values: Mapping[str, float]


def _delta(old: Mapping[str, float], new: Mapping[str, float]) -> dict[str, float]:
    if any(new.get(k, 0.0) < v for k, v in old.items()):
        return dict(new)  # a counter went down: the server restarted
    return {k: v - old.get(k, 0.0) for k, v in new.items()}


def _histogram(totals: Mapping[str, float], key: str) -> dict[float, float]:
    prefix = f"{PREFIX}{key}:"
    return {float(k[len(prefix):]): v for k, v in totals.items() if k.startswith(prefix)}


class SloTracker:
    """Bounded per-endpoint history of ``slo:*`` values."""

    def __init__(self, max_points: int = 512) -> None:
        self._history: dict[str, deque[_Point]] = {}
        self._max = max_points

    def record(self, address: str, at: float, values: Mapping[str, float]) -> None:
        if values:
            self._history.setdefault(address, deque(maxlen=self._max)).append(_Point(at, values))

    def forget(self, keep: set[str]) -> None:
        for address in [a for a in self._history if a not in keep]:
            del self._history[address]

    def _window(self, address: str, since: float) -> dict[str, float]:
        points = self._history.get(address)
        if not points:
            return {}
        start = next((p for p in points if p.at >= since), points[-1])
        return _delta(start.values, points[-1].values) if start is not points[-1] else {}

    def stats(self, addresses: Iterable[str], since: float) -> VersionStats:
        totals: dict[str, float] = {}
        for address in addresses:
            for key, value in self._window(address, since).items():
                totals[key] = totals.get(key, 0.0) + value
        # A 5xx never finishes (no e2e observation): the requests the error rate is over are
        # the finished ones plus the failed ones, so a canary failing everything is judged.
        errors = totals.get(f"{PREFIX}errors", 0.0)
        return VersionStats(requests=totals.get(f"{PREFIX}requests", 0.0) + errors,
                            errors=errors,
                            ttft_p95_s=quantile(0.95, _histogram(totals, "ttft")),
                            itl_p95_s=quantile(0.95, _histogram(totals, "itl")))
