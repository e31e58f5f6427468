"""The benchmark's numbers: per-policy summaries of the measured window, ratios against
``least_request``, the issue's targets, the comparison table, ``bench.json`` and ``bench.png``.

Latency summaries come from the load generator's :func:`~trimtab_dev.loadgen.summarize` over
the requests *scheduled* after the warm-up. Throughput is the work done *inside* the measured
window (``window_throughput``): answers that ended in it, and output tokens generated in it,
each request's tokens spread evenly from its first token to its last. The load generator's
own figure (``summary.throughput``: measured requests over the time to their last answer) is
kept too, but one straggler stretches its denominator, so the comparison does not use it.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trimtab_dev.bench.envoy_configs import BASELINE, REFERENCE
from trimtab_dev.bench.fleet import Fleet
from trimtab_dev.bench.runner import LoadPlan, LoadRun
from trimtab_dev.loadgen import summarize
from trimtab_dev.loadgen.runner import RequestRecord, RunResult
from weight_calculator.localities import document_shares

# (name, description, policy compared with, metric, operator, limit)
Target = tuple[str, str, str, str, str, float]
# Issue 11's targets on a heterogeneous fleet without prompt-size classes: P99 TTFT at most
# half the reference controller's and half ORCA CSWRR's, P50 TTFT and output tokens/s no
# worse than least_request's.
TARGETS: tuple[Target, ...] = (
    ("ttft_p99_vs_reference", "trimtab P99 TTFT / reference", REFERENCE, "ttft_p99", "<=",
     0.5),
    ("ttft_p99_vs_cswrr_orca", "trimtab P99 TTFT / cswrr_orca", "cswrr_orca", "ttft_p99",
     "<=", 0.5),
    ("ttft_p50_vs_least_request", "trimtab P50 TTFT / least_request", "least_request",
     "ttft_p50", "<=", 1.0),
    ("tokens_vs_least_request", "trimtab output tok/s / least_request", "least_request",
     "output_tokens_per_s", ">=", 1.0),
)
# ... and with automatic prompt-size classes (long_context: auto, bench --auto-classes).
CLASS_TARGETS: tuple[Target, ...] = (
    ("ttft_p99_vs_cswrr_orca", "trimtab P99 TTFT / cswrr_orca", "cswrr_orca", "ttft_p99",
     "<=", 0.25),
    ("ttft_p50_vs_least_request", "trimtab P50 TTFT / least_request", "least_request",
     "ttft_p50", "<=", 1.0),
    ("tokens_vs_least_request", "trimtab output tok/s / least_request", "least_request",
     "output_tokens_per_s", ">=", 1.0),
)
# The homogeneous control: identical servers leave a capacity-aware balancer nothing to
# exploit, so trimtab only has to be no worse than least_request within this tolerance
# (docs/simulator.md, "The homogeneous control", says how it was chosen).
HOMOGENEOUS_TOLERANCE = 0.10
RATIO_KEYS = ("ttft_p50", "ttft_p99", "e2e_p99", "req_per_s", "output_tokens_per_s")
_OPS = {"<": lambda v, lim: v < lim, "<=": lambda v, lim: v <= lim,
        ">=": lambda v, lim: v >= lim}


def homogeneous_targets(tolerance: float = HOMOGENEOUS_TOLERANCE) -> tuple[Target, ...]:
    """trimtab no worse than least_request within ``tolerance`` (P99 TTFT and tokens/s)."""
    return (
        ("ttft_p99_vs_least_request", "trimtab P99 TTFT / least_request", "least_request",
         "ttft_p99", "<=", 1.0 + tolerance),
        ("tokens_vs_least_request", "trimtab output tok/s / least_request", "least_request",
         "output_tokens_per_s", ">=", 1.0 - tolerance),
    )


# ---- per policy ---------------------------------------------------------------------------
def measured(run: LoadRun, plan: LoadPlan) -> list[RequestRecord]:
    """The requests scheduled after the warm-up."""
    return [r for r in run.records if r.scheduled_at >= plan.warmup]


def policy_summary(run: LoadRun, plan: LoadPlan, url: str) -> dict[str, Any]:
    """The load generator's report over the measured window, plus ``unfinished``."""
    records = measured(run, plan)
    ends = [r.sent_at + r.e2e for r in records if r.e2e is not None]
    wall = max(ends, default=plan.total) - plan.warmup
    result = RunResult(records=records, offered_rate=plan.rate, duration_s=plan.duration,
                       wall_s=max(wall, 1e-9), targets=[url],
                       started_unix=run.started_unix + plan.warmup, extra={"client": run.client})
    summary = summarize(result)
    summary["unfinished"] = sum(r.error == "unfinished" for r in records)
    summary["window_throughput"] = window_throughput(run.records, plan.warmup, plan.total)
    return summary


def _tokens_in(r: RequestRecord, start: float, end: float) -> float:
    """Output tokens of a successful request generated within ``[start, end]``."""
    assert r.e2e is not None
    last = r.sent_at + r.e2e
    first = r.sent_at + (r.ttft if r.ttft is not None else r.e2e)
    if last <= first:
        return float(r.output_tokens) if start <= last <= end else 0.0
    overlap = max(0.0, min(end, last) - max(start, first))
    return r.output_tokens * overlap / (last - first)


def window_throughput(records: Iterable[RequestRecord], start: float, end: float
                      ) -> dict[str, float]:
    """Answers per second and output tokens per second produced inside ``[start, end]``, by
    every request of the run (warm-up ones included: their tokens are work done in the
    window). Failed and refused requests count nothing."""
    done, tokens = 0, 0.0
    for r in records:
        if not r.served or r.e2e is None:
            continue
        done += start <= r.sent_at + r.e2e <= end
        tokens += _tokens_in(r, start, end)
    span = max(end - start, 1e-9)
    return {"req_per_s": done / span, "output_tokens_per_s": tokens / span, "window_s": span}


def sim_summary(samples: Sequence[tuple[float, Any]], since: float,
                until: float | None = None) -> dict[str, Any]:
    """The simulator's own health from ``since`` (the end of the warm-up) on: loop lag, CPU,
    peak queues per server, and concurrent streams (``in_flight``: requests the simulator
    process was serving; peak and mean of the samples up to ``until``, the end of the
    schedule, so the drain after it does not dilute the mean)."""
    window = [(t, s) for t, s in samples if t >= since] or list(samples)
    if not window:
        return {"samples": 0}
    (t0, first), (t1, last) = window[0], window[-1]
    cpu = (100.0 * (last["cpu_seconds"] - first["cpu_seconds"]) / (t1 - t0)
           if t1 > t0 else last.get("cpu_percent_recent", 0.0))
    flights = [s["in_flight"] for t, s in window
               if "in_flight" in s and (until is None or t <= until)]
    return {"samples": len(window), "cpu_percent": cpu,
            "loop_lag_p50_ms": max(s["loop_lag_p50_ms"] for _, s in window),
            "loop_lag_p99_ms": max(s["loop_lag_p99_ms"] for _, s in window),
            "loop_lag_max_ms": max(s["loop_lag_max_ms"] for _, s in window),
            "in_flight_peak": max(flights, default=None),
            "in_flight_mean": sum(flights) / len(flights) if flights else None,
            "peak_per_server": _peaks(window)}


def _peaks(window: Sequence[tuple[float, Any]]) -> dict[str, dict[str, float]]:
    peaks: dict[str, dict[str, float]] = {}
    for _, s in window:
        for name, server in s["servers"].items():
            peak = peaks.setdefault(name, {"waiting": 0, "running": 0, "kv_usage": 0.0})
            for key in peak:
                peak[key] = max(peak[key], server[key])
    return peaks


def weight_series(samples: Sequence[tuple[float, Any]], fleet: Fleet) -> dict[str, list[Any]]:
    """``{server name: [[t, weight], ...]}`` from trimtab or Envoy weight samples."""
    out: dict[str, list[Any]] = {s.name: [] for s in fleet.servers}
    for t, sample in samples:
        for address, value in sample.items():
            weight = value["weight"] if isinstance(value, dict) else value
            out.setdefault(fleet.name_of(address), []).append([t, weight])
    return out


def effective_shares(sample: Mapping[str, Any]) -> dict[str, float]:
    """The share of new requests trimtab's weights give each endpoint (one ``/v1/weights``
    sample, as :func:`trimtab_weights` keeps it), as Envoy routes them:
    :func:`weight_calculator.localities.document_shares`, the status page's computation."""
    return document_shares({a: v for a, v in sample.items() if isinstance(v, dict)}) | {
        a: 0.0 for a, v in sample.items() if not isinstance(v, dict)}


def share_series(samples: Sequence[tuple[float, Any]], fleet: Fleet) -> dict[str, list[Any]]:
    """``{server name: [[t, percent of new requests], ...]}`` from trimtab's weight samples
    (:func:`effective_shares`)."""
    out: dict[str, list[Any]] = {s.name: [] for s in fleet.servers}
    for t, sample in samples:
        for address, share in effective_shares(sample).items():
            out.setdefault(fleet.name_of(address), []).append([t, round(100.0 * share, 2)])
    return out


def inflight_series(samples: Sequence[tuple[float, Any]]) -> dict[str, list[Any]]:
    """``{server name: [[t, running + waiting], ...]}`` from the simulator's stats samples."""
    out: dict[str, list[Any]] = {}
    for t, sample in samples:
        for name, server in sample.get("servers", {}).items():
            out.setdefault(name, []).append([t, server["running"] + server["waiting"]])
    return out


def policy_entry(run: LoadRun, plan: LoadPlan, url: str, fleet: Fleet,
                 drain_s: float) -> dict[str, Any]:
    """Everything ``bench.json`` keeps about one policy's run."""
    entry: dict[str, Any] = {
        "summary": policy_summary(run, plan, url),
        "client": run.client,
        "sim": sim_summary(run.samples.get("sim", []), plan.warmup, plan.total),
        "drain_before_s": drain_s,
        "envoy_weights": weight_series(run.samples.get("envoy_weights", []), fleet),
        "inflight": inflight_series(run.samples.get("sim", [])),
    }
    if "trimtab_weights" in run.samples:
        entry["trimtab_weights"] = weight_series(run.samples["trimtab_weights"], fleet)
        entry["trimtab_shares"] = share_series(run.samples["trimtab_weights"], fleet)
        entry["trimtab_signals"] = [[t, {fleet.name_of(a): v.get("signals", {})
                                         for a, v in s.items()}]
                                    for t, s in run.samples["trimtab_weights"]]
        entry["trimtab_breakdown"] = [[t, {fleet.name_of(a): v.get("breakdown", {})
                                           for a, v in s.items()}]
                                      for t, s in run.samples["trimtab_weights"]]
    return entry


# ---- comparison ---------------------------------------------------------------------------
def metrics(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """The figures the table and the ratios use, flat."""
    return {
        "ttft_p50": summary["ttft_s"]["p50"], "ttft_p90": summary["ttft_s"]["p90"],
        "ttft_p99": summary["ttft_s"]["p99"],
        "tpot_p50": summary["tpot_s"]["p50"], "tpot_p99": summary["tpot_s"]["p99"],
        "e2e_p50": summary["e2e_s"]["p50"], "e2e_p99": summary["e2e_s"]["p99"],
        "req_per_s": summary["window_throughput"]["req_per_s"],
        "output_tokens_per_s": summary["window_throughput"]["output_tokens_per_s"],
        "output_tokens_per_s_to_last": summary["throughput"]["output_tokens_per_s"],
        "errors": summary["errors"]["count"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def comparison(policies: Mapping[str, Mapping[str, Any]], homogeneous: bool = False,
               tolerance: float = HOMOGENEOUS_TOLERANCE, classes: bool = False
               ) -> dict[str, Any]:
    """Ratios of every policy against ``least_request`` (and ``reference`` when it ran), and
    trimtab's targets: the issue's on a heterogeneous fleet (``CLASS_TARGETS`` when trimtab
    ran with automatic prompt-size classes), "no worse than least_request within
    ``tolerance``" on a homogeneous one."""
    flat = {p: metrics(e["summary"]) for p, e in policies.items()}
    bases = [BASELINE] + [REFERENCE] * (REFERENCE in flat)
    ratios = {p: {f"{k}_vs_{b}": _ratio(m[k], flat[b][k]) if b in flat else None
                  for b in bases for k in RATIO_KEYS}
              for p, m in flat.items()}
    chosen = (homogeneous_targets(tolerance) if homogeneous
              else CLASS_TARGETS if classes else TARGETS)
    target_set = ("homogeneous" if homogeneous
                  else "heterogeneous+auto-classes" if classes else "heterogeneous")
    return {"baseline": BASELINE, "metrics": flat, "ratios": ratios,
            "target_set": target_set,
            "tolerance": tolerance if homogeneous else None,
            "targets": targets(flat, chosen)}


def targets(flat: Mapping[str, Mapping[str, float | None]],
            chosen: Sequence[Target] = TARGETS) -> list[dict[str, Any]]:
    """``chosen`` targets for trimtab; ``met`` is None when a policy was not run."""
    out = []
    mine = flat.get("trimtab")
    for name, text, other, key, op, limit in chosen:
        theirs = flat.get(other)
        value = _ratio(mine[key], theirs[key]) if mine and theirs else None
        met = None if value is None else _OPS[op](value, limit)
        out.append({"name": name, "what": text, "value": value, "op": op, "limit": limit,
                    "met": met})
    if mine is not None:
        errors = mine["errors"] or 0
        out.append({"name": "no_failures", "what": "trimtab errors", "value": errors,
                    "op": "==", "limit": 0, "met": errors == 0})
    return out


# ---- the table ----------------------------------------------------------------------------
def fmt_s(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_n(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


LATENCY_COLUMNS = ("policy", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99",
                   "E2E p50", "E2E p99", "req/s", "out tok/s", "tok/s to last", "errors",
                   "P50 TTFT vs LR", "P99 TTFT vs LR", "tok/s vs LR", "P99 TTFT vs ref",
                   "tok/s vs ref")
HEALTH_COLUMNS = ("policy", "client lag p99", "client CPU s", "sim lag p99", "sim lag max",
                  "sim CPU %", "streams peak", "streams mean", "unfinished", "drain before")


def latency_rows(report: Mapping[str, Any]) -> list[list[str]]:
    cmp = report["comparison"]
    rows = []
    for policy, m in cmp["metrics"].items():
        r = cmp["ratios"][policy]
        rows.append([policy, fmt_s(m["ttft_p50"]), fmt_s(m["ttft_p90"]), fmt_s(m["ttft_p99"]),
                     fmt_s(m["tpot_p50"]), fmt_s(m["tpot_p99"]), fmt_s(m["e2e_p50"]),
                     fmt_s(m["e2e_p99"]), fmt_n(m["req_per_s"], 2),
                     fmt_n(m["output_tokens_per_s"], 0), fmt_n(m["output_tokens_per_s_to_last"], 0),
                     str(m["errors"]),
                     fmt_x(r["ttft_p50_vs_least_request"]), fmt_x(r["ttft_p99_vs_least_request"]),
                     fmt_x(r["output_tokens_per_s_vs_least_request"]),
                     fmt_x(r.get(f"ttft_p99_vs_{REFERENCE}")),
                     fmt_x(r.get(f"output_tokens_per_s_vs_{REFERENCE}"))])
    return rows


def health_rows(report: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for policy, entry in report["policies"].items():
        client, sim = entry["client"], entry["sim"]
        rows.append([policy, f"{client['loop_lag_p99_ms']:.1f} ms",
                     f"{client['cpu_seconds']:.1f}",
                     f"{sim.get('loop_lag_p99_ms', 0.0):.1f} ms",
                     f"{sim.get('loop_lag_max_ms', 0.0):.0f} ms",
                     f"{sim.get('cpu_percent', 0.0):.0f}",
                     fmt_n(sim.get("in_flight_peak"), 0), fmt_n(sim.get("in_flight_mean"), 0),
                     str(entry["summary"]["unfinished"]), f"{entry['drain_before_s']:.1f} s"])
    return rows


def target_lines(report: Mapping[str, Any]) -> list[str]:
    cmp = report["comparison"]
    if cmp.get("target_set") == "homogeneous":
        lines = [f"targets (homogeneous fleet): trimtab no worse than least_request within "
                 f"noise, tolerance {cmp['tolerance']:g}"]
    elif cmp.get("target_set") == "surge":
        lines = ["targets (surge, issue 23's)"]
    else:
        lines = [f"targets ({cmp.get('target_set', 'heterogeneous')} fleet, issue 11's)"]
    for t in cmp["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"{t['what']}: {value} (target {t['op']} {t['limit']:g}) -> {verdict}")
    return lines


def plain_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = [list(columns), *map(list, rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths,
                                                                                       strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def print_report(report: Mapping[str, Any]) -> None:
    """The comparison table, the measurement-health table and the targets (rich if present)."""
    title = (f"{report['config']['fleet']} x {report['config']['workload']}  "
             f"seed {report['seed']}  rate {report['config']['rate']:g} req/s  "
             f"{report['config']['duration']:g} s measured")
    tables = [(title, LATENCY_COLUMNS, latency_rows(report)),
              ("measurement health (load generator, simulator)", HEALTH_COLUMNS,
               health_rows(report))]
    if report["comparison"].get("surge"):
        from trimtab_dev.bench.surge_tables import surge_tables

        tables.extend(surge_tables(report))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for name, columns, rows in tables:
            print(f"\n{name}\n{plain_table(columns, rows)}")
        print("\n".join(["", *target_lines(report)]), flush=True)
        return
    console = Console(width=None if sys.stdout.isatty() else 200)
    for name, columns, rows in tables:
        table = Table(title=name)
        for i, column in enumerate(columns):
            table.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for line in target_lines(report):
        console.print(line, highlight=False)


# ---- files --------------------------------------------------------------------------------
def write_json(report: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, sort_keys=False) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    with path.open() as lines:
        return [RequestRecord(**json.loads(line)) for line in lines if line.strip()]


def ttft_values(run: LoadRun, plan: LoadPlan) -> list[float]:
    """TTFTs of the successful measured requests (for the CDF)."""
    return [r.ttft for r in measured(run, plan) if r.served and r.ttft is not None]


def write_records(run: LoadRun, path: Path) -> None:
    with path.open("w") as out:
        for rec in run.records:
            out.write(json.dumps(rec.to_dict()) + "\n")


def write_png(report: Mapping[str, Any], ttfts: Mapping[str, Sequence[float]],
              path: Path) -> bool:
    """See :func:`trimtab_dev.bench.plots.write_png`."""
    from trimtab_dev.bench import plots

    return plots.write_png(report, ttfts, path)

