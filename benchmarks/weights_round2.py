"""Issue 11, rounds 2 and 3: trimtab's ratios per seed (and their median) from ``trimtab bench``
runs.

    python benchmarks/weights_round2.py benchmarks/results/r2 [docs/results/weights-round2.json]
    python benchmarks/weights_round2.py benchmarks/results/r3 [docs/results/weights-round3.json]

Reads ``ROOT/<scenario>/seed-<S>/bench.json`` (a ``--seeds`` run's layout; or
``ROOT/<scenario>/bench.json``, a ``--seed`` run's) and prints one
markdown table per scenario: trimtab's P99 TTFT against reference and cswrr_orca, its P50
TTFT and output tokens/s against least_request, its P99 against least_request, and the
simulator's event-loop lag (p99 / max over trimtab's leg: the measurement's health). Every
ratio comes from one bench run (the policies of a seed ran back to back on one fleet).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

RATIOS = (("P99/ref", "ttft_p99", "reference"), ("P99/cswrr", "ttft_p99", "cswrr_orca"),
          ("P99/LR", "ttft_p99", "least_request"), ("P50/LR", "ttft_p50", "least_request"),
          ("tok/s/LR", "output_tokens_per_s", "least_request"))


def seed_row(doc: dict[str, Any]) -> dict[str, Any]:
    m = doc["comparison"]["metrics"]
    mine = m.get("trimtab", {})
    row: dict[str, Any] = {"seed": doc["seed"]}
    for label, key, other in RATIOS:
        theirs = m.get(other, {}).get(key)
        row[label] = mine.get(key) / theirs if mine.get(key) is not None and theirs else None
    row["figures"] = {p: {k: v[k] for k in ("ttft_p50", "ttft_p99", "output_tokens_per_s",
                                             "errors")} for p, v in m.items()}
    sim = doc["policies"].get("trimtab", {}).get("sim", {})
    row["lag"] = max((e.get("sim", {}).get("loop_lag_p99_ms") or 0.0)
                     for e in doc["policies"].values())
    row["lag_trimtab"] = (sim.get("loop_lag_p99_ms"), sim.get("loop_lag_max_ms"))
    return row


def scenario(path: Path) -> list[dict[str, Any]]:
    files = sorted(path.glob("seed-*/bench.json")) or sorted(path.glob("bench.json"))
    docs = [json.loads(p.read_text()) for p in files]
    return [seed_row(d) for d in docs]


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(name: str, rows: list[dict[str, Any]]) -> str:
    labels = [label for label, _, _ in RATIOS]
    out = [f"### {name}", "", "| seed | " + " | ".join(labels) + " | sim lag p99 (worst leg) |",
           "|---" * (len(labels) + 2) + "|"]
    for r in rows:
        out.append(f"| {r['seed']} | " + " | ".join(fmt(r[k]) for k in labels)
                   + f" | {r['lag']:.0f} ms |")
    if len(rows) > 1:
        med = [statistics.median([r[k] for r in rows if r[k] is not None] or [float("nan")])
               for k in labels]
        out.append("| **median** | " + " | ".join(f"**{v:.2f}**" for v in med) + " | |")
    out.append("")
    out.append("| seed | policy | TTFT p50 | TTFT p99 | out tok/s | errors |")
    out.append("|---|---|---|---|---|---|")
    for r in rows:
        for p, f in r["figures"].items():
            out.append(f"| {r['seed']} | {p} | {f['ttft_p50'] * 1e3:.0f} ms | "
                       f"{f['ttft_p99']:.2f} s | {f['output_tokens_per_s']:.0f} | {f['errors']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    root = Path(sys.argv[1])
    summary = {}
    for path in sorted(p for p in root.iterdir()
                       if p.is_dir() and (any(p.glob("seed-*/bench.json"))
                                          or (p / "bench.json").exists())):
        rows = scenario(path)
        summary[path.name] = rows
        print(table(path.name, rows))
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
