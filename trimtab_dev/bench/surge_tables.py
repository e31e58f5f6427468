"""The surge scenario's tables (figures from :mod:`.surge`): one row per policy, and the
goodput of every tenant when the workload has tenants."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trimtab_dev.bench.envoy_configs import BASELINE, REFERENCE
from trimtab_dev.bench.report import fmt_n, fmt_s, fmt_x

SURGE_COLUMNS = ("policy", "requests", "goodput", "good tok/s", "served P99 TTFT", "refused",
                 "refusal p50", "refusal p99", "OpenAI+RA", "recover",
                 "after surge in SLO", "errors", "good tok/s vs LR", "good tok/s vs ref")
Table = tuple[str, tuple[str, ...], list[list[str]]]


def fmt_frac(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _recover(m: Mapping[str, Any], end_s: float) -> str:
    if m["recovery_s"] is None:
        return f"> {end_s:.0f} s"
    return f"{m['recovery_s']:.1f} s"


def surge_rows(report: Mapping[str, Any]) -> list[list[str]]:
    cmp = report["comparison"]
    left = report["config"]["warmup"] + report["config"]["duration"] - cmp["surge"]["spec"][
        "end_s"]
    rows = []
    for policy, m in cmp["surge"]["metrics"].items():
        r = cmp["ratios"][policy]
        shaped = (f"{m['refusals_openai_retry_after']}/{m['refused']}" if m["refused"]
                  else "-")
        rows.append([policy, str(m["requests"]), fmt_frac(m["goodput"]),
                     fmt_n(m["good_tokens_per_s"], 0), fmt_s(m["served_ttft_p99"]),
                     str(m["refused"]), fmt_s(m["refusal_p50"]), fmt_s(m["refusal_p99"]),
                     shaped, _recover(m, left), fmt_frac(m["after_surge_within_slo"]),
                     str(m["errors"]), fmt_x(r.get(f"good_tokens_per_s_vs_{BASELINE}")),
                     fmt_x(r.get(f"good_tokens_per_s_vs_{REFERENCE}"))])
    return rows


def tenant_columns(report: Mapping[str, Any]) -> tuple[str, ...]:
    metrics = report["comparison"]["surge"]["metrics"]
    names = next(iter(metrics.values()))["per_tenant"] if metrics else {}
    return ("policy", *(f"{name} goodput" for name in names))


def tenant_rows(report: Mapping[str, Any]) -> list[list[str]]:
    return [[policy, *(f"{fmt_frac(t['goodput'])} ({t['refused']} refused)"
                       for t in m["per_tenant"].values())]
            for policy, m in report["comparison"]["surge"]["metrics"].items()]


def surge_tables(report: Mapping[str, Any]) -> list[Table]:
    """The surge table, and the tenants' when there are tenants."""
    spec = report["comparison"]["surge"]["spec"]
    title = (f"surge: x{spec['factor']:g} from {spec['start_s']:g} s to {spec['end_s']:g} s, "
             f"TTFT SLO {spec['slo_s']:g} s, tick {spec['tick_s']:g} s")
    tables: list[Table] = [(title, SURGE_COLUMNS, surge_rows(report))]
    if spec["tenants"]:
        tables.append(("goodput per tenant", tenant_columns(report), tenant_rows(report)))
    return tables
