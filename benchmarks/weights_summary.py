"""Summarise issue 11's weight benchmarks (``trimtab bench`` runs) into one table and JSON.

    python benchmarks/weights_summary.py benchmarks/results/weights docs/results/weights-summary.json

Reads ``ROOT/<scenario>/seed-<S>/bench.json`` for the scenarios below (whichever exist) and
prints, per scenario and seed, each policy's TTFT P50/P99 and output tokens/s, trimtab's
ratios against least_request, reference and cswrr_orca, and the simulator's event-loop lag
(the measurement-health figure). trimtab variants run in their own bench invocation on the
same seed (the same request schedule) are compared with that seed's baselines.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

# scenario -> (directory of the baselines, {variant label: directory of a trimtab-only run})
SCENARIOS: dict[str, tuple[str, dict[str, str]]] = {
    # "trimtab" from hetero-rr replaces the base run's row where it exists (seed 42: the base
    # run's trimtab predates counting in-flight work), and "reference" from hetero-ref (seed
    # 42: the base run's reference ran with the simulator lagging 661 ms); see weights.md
    "hetero": ("hetero", {"trimtab": "hetero-rr", "reference": "hetero-ref",
                          "trimtab+auto-classes": "hetero-auto",
                          "trimtab (no standby)": "hetero-rr-nostandby",
                          "trimtab+least_request": "hetero-lr"}),
    "homogeneous": ("homogeneous", {}),
    "chat-only": ("chat", {}),
    "bursty": ("bursty", {}),
    "prefill-heavy": ("prefill", {}),
}


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _row(policy: str, entry: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    sim = entry.get("sim", {})
    return {"policy": policy, "ttft_p50": metrics["ttft_p50"], "ttft_p99": metrics["ttft_p99"],
            "tokens_per_s": metrics["output_tokens_per_s"], "errors": metrics["errors"],
            "unfinished": entry["summary"].get("unfinished"),
            "sim_lag_p99_ms": sim.get("loop_lag_p99_ms"),
            "sim_lag_max_ms": sim.get("loop_lag_max_ms")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def scenario(root: Path, base_dir: str, variants: dict[str, str]) -> dict[str, Any]:
    seeds: dict[str, Any] = {}
    for seed_dir in sorted((root / base_dir).glob("seed-*")):
        doc = _load(seed_dir / "bench.json")
        if doc is None:
            continue
        rows = {p: _row(p, doc["policies"][p], m)
                for p, m in doc["comparison"]["metrics"].items()}
        for label, vdir in variants.items():
            vdoc = _load(root / vdir / seed_dir.name / "bench.json")
            source = label if label in ("trimtab", "reference") else "trimtab"
            if vdoc is not None and source in vdoc["policies"]:
                rows[label] = _row(label, vdoc["policies"][source],
                                   vdoc["comparison"]["metrics"][source])
        base = {p: rows.get(p) for p in ("least_request", "reference", "cswrr_orca")}
        for row in rows.values():
            for name, b in base.items():
                if b is not None:
                    row[f"p99_vs_{name}"] = _ratio(row["ttft_p99"], b["ttft_p99"])
            if base["least_request"] is not None:
                row["p50_vs_least_request"] = _ratio(row["ttft_p50"],
                                                     base["least_request"]["ttft_p50"])
                row["tokens_vs_least_request"] = _ratio(row["tokens_per_s"],
                                                        base["least_request"]["tokens_per_s"])
        seeds[seed_dir.name.removeprefix("seed-")] = rows
    spread: dict[str, dict[str, Any]] = {}
    for rows in seeds.values():
        for policy, row in rows.items():
            for key, value in row.items():
                if key.endswith(("_vs_least_request", "_vs_reference", "_vs_cswrr_orca")):
                    spread.setdefault(policy, {}).setdefault(key, []).append(value)
    stats = {p: {k: {"min": min(v), "median": statistics.median(v), "max": max(v), "n": len(v)}
                 for k, v in keys.items() if all(x is not None for x in v)}
             for p, keys in spread.items()}
    return {"seeds": seeds, "spread": stats}


def fmt(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "x":
        return f"{v:.2f}×"
    return f"{v:.0f}"


def markdown(summary: dict[str, Any]) -> str:
    out = []
    for name, sc in summary.items():
        if not sc["seeds"]:
            continue
        out.append(f"\n### {name}\n")
        out.append("| seed | policy | TTFT p50 | TTFT p99 | out tok/s | P99 / ref | P99 / cswrr "
                   "| P50 / LR | tok/s / LR | unfinished | sim lag p99 / max |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for seed, rows in sc["seeds"].items():
            for p, r in rows.items():
                out.append(f"| {seed} | {p} | {fmt(r['ttft_p50'], 's')} | {fmt(r['ttft_p99'], 's')} "
                           f"| {fmt(r['tokens_per_s'])} | {fmt(r.get('p99_vs_reference'), 'x')} "
                           f"| {fmt(r.get('p99_vs_cswrr_orca'), 'x')} "
                           f"| {fmt(r.get('p50_vs_least_request'), 'x')} "
                           f"| {fmt(r.get('tokens_vs_least_request'), 'x')} | {r['unfinished']} "
                           f"| {fmt(r['sim_lag_p99_ms'])} / {fmt(r['sim_lag_max_ms'])} ms |")
        if len(sc["seeds"]) > 1:
            out.append("\nmin / median / max over seeds:\n")
            out.append("| policy | P99 / ref | P99 / cswrr | P50 / LR | tok/s / LR |")
            out.append("|---|---|---|---|---|")
            for p, st in sc["spread"].items():
                cells = []
                for k in ("p99_vs_reference", "p99_vs_cswrr_orca", "p50_vs_least_request",
                          "tokens_vs_least_request"):
                    s = st.get(k)
                    cells.append("-" if s is None else
                                 f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f}")
                out.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    root = Path(argv[1])
    summary = {name: scenario(root, base, variants)
               for name, (base, variants) in SCENARIOS.items()}
    if len(argv) > 2:
        Path(argv[2]).write_text(json.dumps(summary, indent=1) + "\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
