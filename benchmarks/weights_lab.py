"""Issue 11, round 3: screen weight policies over a suite of fleets, loads and workloads in the
policy lab (virtual time, Envoy's balancers emulated: trimtab_dev/lab). Screening, not a
claim: the claims come from ``trimtab bench`` through a real Envoy.

    python benchmarks/weights_lab.py --seeds 12 --out docs/results/weights/round3/lab.json \\
        --policy trimtab --policy "trimtab capacity_tiers=false utilisation=saturated"

Per scenario and policy it prints the median over seeds of P99/reference, P99/least_request,
P99 TTFT, P50/least_request and output tokens/s over least_request (each ratio from one
seed's runs on the same schedule), and, for every policy after the first one given, its P99
and P50 against the first one's as the geometric mean of the per-seed ratios with a 2-sigma
interval (a paired comparison: the same seeds, so schedule noise cancels). Writes every
run's summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from trimtab_dev.lab.__main__ import parse_policy, run_one

# name: (fleet, workload, rate or None for the workload's)
SCENARIOS: dict[str, tuple[str, str, float | None]] = {
    "mixed17": ("examples/fleet-hetero.yaml", "examples/workload-mixed.yaml", None),
    "mixed12": ("examples/fleet-hetero.yaml", "examples/workload-mixed.yaml", 12.0),
    "mixed21": ("examples/fleet-hetero.yaml", "examples/workload-mixed.yaml", 21.0),
    "chat": ("examples/fleet-hetero.yaml", "examples/workload-chat.yaml", None),
    "bursty": ("examples/fleet-hetero.yaml", "examples/workload-bursty.yaml", None),
    "homogeneous": ("examples/fleet-homogeneous.yaml", "examples/workload-mixed.yaml", 7.9),
    "prefill-heavy": ("examples/fleet-hetero-prefill-heavy.yaml",
                      "examples/workload-mixed.yaml", 4.9),
    "fleet-b": ("examples/fleet-hetero-b.yaml", "examples/workload-long10.yaml", None),
    "fleet-c": ("examples/fleet-hetero-c.yaml", "examples/workload-mixed.yaml", 22.0),
    # ~2.4x the fleet's capacity (issue 23): a collapse test, read on output tokens/s
    "prefill-overload": ("examples/fleet-hetero-prefill-heavy.yaml",
                         "examples/workload-mixed.yaml", 17.0),
}
BASELINES = ("least_request", "reference")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _paired(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str
            ) -> tuple[float, float, float]:
    logs = [math.log(a[key] / b[key]) for a, b in zip(rows, base, strict=True)
            if a.get(key) and b.get(key)]
    if len(logs) < 2:
        return math.nan, math.nan, math.nan
    mean = statistics.fmean(logs)
    err = 2 * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - err), math.exp(mean + err)


def _ratio(rows: list[dict[str, Any]], to: list[dict[str, Any]], key: str) -> float:
    return _median([a[key] / b[key] for a, b in zip(rows, to, strict=True)
                    if a.get(key) and b.get(key)])


def report(runs: dict[tuple[str, str, int], dict[str, Any]], scenarios: list[str],
           policies: list[str], seeds: list[int]) -> list[str]:
    lines = []
    candidates = [p for p in policies if p not in BASELINES]
    for name in scenarios:
        lines.append(f"== {name}")
        ref = [runs[(name, "reference", s)] for s in seeds]
        lr = [runs[(name, "least_request", s)] for s in seeds]
        for p in policies:
            rows = [runs[(name, p, s)] for s in seeds]
            p99 = _median([r["ttft_p99"] for r in rows])
            line = (f"  {p:48s} P99/ref {_ratio(rows, ref, 'ttft_p99'):5.2f}  P99/LR "
                    f"{_ratio(rows, lr, 'ttft_p99'):5.2f}  P99 {p99:6.2f}s  P50/LR "
                    f"{_ratio(rows, lr, 'ttft_p50'):5.2f}  tok/LR "
                    f"{_ratio(rows, lr, 'output_tokens_per_s'):5.2f}  unfinished "
                    f"{sum(r['unfinished'] for r in rows)}")
            if candidates and p in candidates[1:]:
                base = [runs[(name, candidates[0], s)] for s in seeds]
                g99, lo, hi = _paired(rows, base, "ttft_p99")
                g50, _, _ = _paired(rows, base, "ttft_p50")
                line += f"  vs {candidates[0]}: P99 x{g99:.2f} [{lo:.2f}, {hi:.2f}] P50 x{g50:.2f}"
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--seeds", type=int, default=12, help="seeds 1..N")
    p.add_argument("--policy", action="append", dest="policies", default=[],
                   help="a lab policy (python -m trimtab_dev.lab); least_request and "
                        "reference always run; the first one given is the paired baseline")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out")
    a = p.parse_args(argv)
    scenarios = a.scenarios.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios: {unknown}")
    policies = [*BASELINES, *(x for x in a.policies or ["trimtab"] if x not in BASELINES)]
    for policy in policies:
        parse_policy(policy)
    seeds = list(range(1, a.seeds + 1))
    keys = [(s, pol, seed) for s in scenarios for pol in policies for seed in seeds]
    jobs = [(SCENARIOS[s][0], SCENARIOS[s][1], pol, seed, 6.0, a.duration, 30.0,
             SCENARIOS[s][2], False) for s, pol, seed in keys]
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        runs = dict(zip(keys, pool.map(run_one, jobs, chunksize=1), strict=True))
    print("\n".join(report(runs, scenarios, policies, seeds)))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({
            "args": vars(a), "scenarios": {s: SCENARIOS[s] for s in scenarios},
            "runs": [{"scenario": s, **runs[(s, pol, seed)]} for s, pol, seed in keys]},
            indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
