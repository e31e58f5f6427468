"""The counters canary gates judge a version by, read from the same indexed page as the
weight signals (the page is parsed once).

Names: vLLM ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
(older ``vllm:time_per_output_token_seconds``, used only when the newer one is absent),
``vllm:e2e_request_latency_seconds_count`` (finished requests) and the API server's
``http_requests_total{status="5xx"|...}`` (prometheus-fastapi-instrumentator, which vLLM
uses) for errors; SGLang ``sglang:time_to_first_token_seconds`` /
``sglang:inter_token_latency_seconds`` / ``sglang:e2e_request_latency_seconds``. Series of
one name are summed; a NaN, infinite or negative sum is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from xds_server.telemetry.parsers.reader import Series
from xds_server.telemetry.reading import SloCounters

TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
       "sglang:inter_token_latency_seconds")
FINISHED = ("vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds")
HTTP_REQUESTS = "http_requests_total"


def slo_counters(index: Mapping[str, list[Series]]) -> SloCounters | None:
    """The page's :class:`SloCounters`, or ``None`` when it has none of their series."""
    ttft = _buckets(index, TTFT, first_only=False)
    itl = _buckets(index, ITL, first_only=True)
    requests = _sum(v for name in FINISHED for _, v in index.get(f"{name}_count", []))
    errors = _sum(v for labels, v in index.get(HTTP_REQUESTS, [])
                  if str(labels.get("status", "")).startswith("5"))
    if not ttft and not itl and requests is None and errors is None:
        return None
    return SloCounters(ttft, itl, requests or 0.0, errors or 0.0)


def _buckets(index: Mapping[str, list[Series]], names: Sequence[str],
             first_only: bool) -> dict[float, float]:
    totals: dict[float, float] = {}
    for name in names:
        rows = index.get(f"{name}_bucket", [])
        for labels, value in rows:
            bound = _bound(labels.get("le"))
            if bound is not None:
                totals[bound] = totals.get(bound, 0.0) + value
        if rows and first_only:
            break
    return {k: v for k, v in totals.items() if math.isfinite(v) and v >= 0}


def _bound(le: str | None) -> float | None:
    try:
        return None if le is None else float(le)
    except ValueError:
        return None


def _sum(values: Iterable[float]) -> float | None:
    items = list(values)
    if not items:
        return None
    total = float(sum(items))
    return total if math.isfinite(total) and total >= 0 else None
