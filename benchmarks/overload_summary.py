"""Markdown rows for docs/results/overload.md from merged surge runs (benchmarks/merge_bench.py)
and, for the tenant target, a flood run beside its calm one.

    python -m benchmarks.overload_summary surge DIR [DIR ...]
    python -m benchmarks.overload_summary tenants CALM_DIR FLOOD_DIR [TENANT]

``surge`` prints, per run and policy, the median [min..max] over the seeds of the surge
figures; ``tenants`` prints the other tenants' goodput (requests served whole within the SLO,
of those measured) per seed without and with the flood, and the ratio the issue judges.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIGURES = (("goodput", "goodput", "{:.3f}"), ("good_tokens_per_s", "good tok/s", "{:.0f}"),
           ("served_ttft_p99", "served P99 TTFT (s)", "{:.2f}"), ("refused", "refused", "{:.0f}"),
           ("refusal_p99", "refusal p99 (ms)", "{:.0f}"), ("recovery_s", "recover (s)", "{:.1f}"),
           ("after_surge_within_slo", "after surge in SLO", "{:.3f}"))


def _cell(stats: dict, fmt: str, scale: float = 1.0) -> str:
    if any(stats.get(k) is None for k in ("min", "median", "max")):
        return "-"
    lo, mid, hi = (stats[k] * scale for k in ("min", "median", "max"))
    return f"{fmt.format(mid)} [{fmt.format(lo)}..{fmt.format(hi)}]"


def surge(dirs: list[str]) -> None:
    print("| run | policy | " + " | ".join(label for _, label, _ in FIGURES) + " |")
    print("|---|---|" + "---|" * len(FIGURES))
    for d in dirs:
        spread = json.loads((Path(d) / "spread.json").read_text())
        for policy, figures in spread["surge"].items():
            cells = [_cell(figures[key], fmt, 1000.0 if key == "refusal_p99" else 1.0)
                     if key in figures else "-" for key, _, fmt in FIGURES]
            print(f"| {Path(d).name} | {policy} | " + " | ".join(cells) + " |")
        for name, target in spread["targets"].items():
            print(f"<!-- {Path(d).name} {name}: median {target['median']:.3g} "
                  f"[{target['min']:.3g}..{target['max']:.3g}] {target['op']} {target['limit']}, "
                  f"met on {target['met']} of {target['of']} -->")


def _goodput(path: Path, flooder: str, slo: float, warmup: float) -> float:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    others = [r for r in records if r["scheduled_at"] >= warmup and r.get("tenant") != flooder]
    good = [r for r in others if r["status"] == 200 and r["ttft"] is not None
            and r["ttft"] <= slo]
    return len(good) / len(others) if others else 0.0


def tenants(calm: str, flood: str, flooder: str = "t0") -> None:
    ratios = []
    for seed_dir in sorted(Path(flood).glob("seed-*")):
        doc = json.loads((seed_dir / "bench.json").read_text())
        slo, warmup = 3.0, float(doc["config"]["warmup"])
        for policy in doc["policies"]:
            name = f"records-{policy}.jsonl"
            before = _goodput(Path(calm) / seed_dir.name / name, flooder, slo, warmup)
            after = _goodput(seed_dir / name, flooder, slo, warmup)
            ratios.append(after / before)
            print(f"| {seed_dir.name} | {policy} | {before:.3f} | {after:.3f} | "
                  f"{after / before:.3f} |")
    print(f"median ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}..{max(ratios):.3f}]")


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "surge":
        surge(argv[1:])
    elif len(argv) in (3, 4) and argv[0] == "tenants":
        tenants(*argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
