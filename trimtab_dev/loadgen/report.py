"""Turn request records into the JSON report: percentiles, throughput, errors, breakdowns.

Latency percentiles are over served requests only (a failed or refused request has no
TTFT); the error count and kinds, and the refusals (HTTP 429: count, time to the answer,
OpenAI shape, Retry-After), sit next to them so a policy cannot look fast by failing or
refusing requests.
Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from trimtab_dev.loadgen.refusals import refusal_summary
from trimtab_dev.loadgen.runner import RequestRecord, RunResult

QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already-sorted values (``q`` in 0..1)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """``count``, ``mean``, ``min``, ``max`` and p50/p90/p99 (``None`` when empty)."""
    vals = sorted(v for v in values if v is not None)
    out: dict[str, float | int | None] = {"count": len(vals)}
    if not vals:
        out.update({"mean": None, "min": None, "max": None, **{k: None for k, _ in QUANTILES}})
        return out
    out.update({"mean": sum(vals) / len(vals), "min": vals[0], "max": vals[-1]})
    out.update({k: percentile(vals, q) for k, q in QUANTILES})
    return out


def _latencies(ok: list[RequestRecord]) -> dict[str, Any]:
    return {
        "ttft_s": distribution(r.ttft for r in ok),
        "tpot_s": distribution(r.tpot for r in ok),
        "e2e_s": distribution(r.e2e for r in ok),
        "output_tokens": distribution(float(r.output_tokens) for r in ok),
    }


def _by(records: list[RequestRecord], key: str) -> dict[str, Any]:
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(str(getattr(r, key)), []).append(r)
    out = {}
    for name, group in sorted(groups.items()):
        ok = [r for r in group if r.served]
        refused = sum(r.refused for r in group)
        out[name] = {"count": len(group), "errors": len(group) - len(ok) - refused,
                     "refused": refused, "ttft_s": distribution(r.ttft for r in ok),
                     "e2e_s": distribution(r.e2e for r in ok)}
    return out


def summarize(result: RunResult) -> dict[str, Any]:
    """The report for one run (every field always present)."""
    records = result.records
    ok = [r for r in records if r.served]
    refused = [r for r in records if r.refused]
    failed = len(records) - len(ok) - len(refused)
    per_s = 1.0 / result.wall_s if result.wall_s > 0 else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    kinds = Counter(r.error for r in records if r.error is not None)
    tenants = any(r.tenant is not None for r in records)
    return {
        "targets": result.targets,
        "started_unix": result.started_unix,
        "offered_rate": result.offered_rate,
        "duration_s": result.duration_s,
        "wall_s": result.wall_s,
        "requests": {"sent": len(records), "completed": len(ok), "errors": failed,
                     "refused": len(refused)},
        "errors": {"count": failed, "by_kind": dict(sorted(kinds.items()))},
        "refusals": {**refusal_summary(refused),
                     "latency_s": distribution(r.e2e for r in refused)},
        "throughput": {"req_per_s": len(ok) * per_s, "output_tokens_per_s": out_tokens * per_s,
                       "sent_per_s": len(records) / result.duration_s},
        **_latencies(ok),
        "per_class": _by(records, "cls"),
        "per_server": _by(records, "server"),
        **({"per_tenant": _by(records, "tenant")} if tenants else {}),
        **result.extra,
    }


def sweep_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows per offered rate, plus how throughput decays past the peak."""
    rows = []
    for r in reports:
        rows.append({
            "offered_rate": r["offered_rate"],
            "req_per_s": r["throughput"]["req_per_s"],
            "output_tokens_per_s": r["throughput"]["output_tokens_per_s"],
            "served_fraction": r["throughput"]["req_per_s"] / r["offered_rate"],
            "errors": r["errors"]["count"],
            "ttft_p99_s": r["ttft_s"]["p99"],
            "e2e_p99_s": r["e2e_s"]["p99"],
        })
    peak = max((row["output_tokens_per_s"] for row in rows), default=0.0)
    for row in rows:
        row["decay_from_peak"] = 1.0 - row["output_tokens_per_s"] / peak if peak > 0 else 0.0
    best = max(rows, key=lambda row: row["output_tokens_per_s"]) if rows else None
    return {"mode": "sweep", "rows": rows,
            "peak": {"offered_rate": best["offered_rate"] if best else None,
                     "output_tokens_per_s": peak},
            "runs": reports}
