"""``python -m trimtab_dev.lab``: screen weight policies over many seeds in virtual time.

    python -m trimtab_dev.lab --fleet examples/fleet-hetero.yaml \\
        --workload examples/workload-mixed.yaml --seeds 1-10 --duration 60 \\
        --policy least_request --policy reference --policy cswrr_orca \\
        --policy "trimtab" --policy "trimtab capacity_tiers=false" --out /tmp/lab.json

A policy is a kind (least_request, round_robin, reference, cswrr_orca, trimtab) and, for
trimtab, ``key=value`` overrides of ``weights.queueing`` plus ``lb=``, ``bias=`` and
``weights=`` (the policy name). Prints per policy the median over seeds of P50/P99 TTFT and
output tokens/s, and the median of each seed's ratio to the reference and to least_request;
writes every run's summary as JSON. Screening only: claims come from ``trimtab bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from trimtab_dev.lab.controllers import (
    Controller,
    Cswrr,
    Fixed,
    Reference,
    Static,
    Trimtab,
    trimtab_config,
)
from trimtab_dev.lab.envoy_lb import Envoy, Oracle
from trimtab_dev.lab.world import World
from trimtab_dev.loadgen.workload import build_schedule, load_workload
from trimtab_dev.sim.fleet import expand, load_fleet

KINDS = ("least_request", "round_robin", "reference", "cswrr_orca", "trimtab", "fixed", "oracle")


def parse_policy(text: str) -> tuple[str, dict[str, Any]]:
    kind, *rest = text.split()
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown policy kind {kind!r}; one of {KINDS}")
    knobs: dict[str, Any] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        try:
            knobs[key] = float(value)
        except ValueError:
            knobs[key] = {"true": True, "false": False}.get(value.lower(), value)
    return kind, knobs


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


def build(policy: str, addresses: list[str], seed: int) -> tuple[Envoy, Controller]:
    kind, knobs = parse_policy(policy)
    if kind in ("least_request", "round_robin"):
        return Envoy(kind, addresses, seed, choices=int(knobs.get("choices", 2))), Static()
    if kind == "oracle":
        return Oracle({}, bool(knobs.get("size_aware", False))), Static()  # type: ignore[return-value]
    if kind == "reference":
        return Envoy("least_request", addresses, seed), Reference()
    if kind == "cswrr_orca":
        return Envoy("weighted", addresses, seed), Cswrr()
    lb = str(knobs.pop("lb", "least_request"))
    bias = knobs.pop("bias", None)
    choices = int(knobs.pop("choices", 2 if kind == "fixed" else -1))
    if kind == "fixed":
        return (Envoy(lb, addresses, seed, bias=1.0 if bias is None else float(bias),
                      choices=choices),
                Fixed({k: v for k, v in knobs.items() if k != "loc"}, bool(knobs.get("loc"))))
    weights = str(knobs.pop("weights", "queueing"))
    auto = bool(knobs.pop("auto_classes", False))
    config = trimtab_config(addresses, lb, knobs, weights, bias, auto)
    if choices < 0:
        choices = config.pools[0].choice_count
    envoy_bias = 1.0 if bias is None else float(bias)
    return Envoy(lb, addresses, seed, bias=envoy_bias, choices=choices), Trimtab(config)


def run_one(args: tuple[str, str, str, int, float, float, float, float | None, bool]
            ) -> dict[str, Any]:
    fleet_path, workload_path, policy, seed, warmup, duration, tail, rate, trace = args
    spec, w = load_fleet(fleet_path), load_workload(workload_path)
    configs = [c for c in expand(spec) if not c.faults.dead]
    addresses = [f"10.0.0.{i + 1}:8000" for i in range(len(configs))]
    schedule = build_schedule(w, rate=rate or w.rate, duration=warmup + duration, seed=seed)
    envoy, controller = build(policy, addresses, seed)
    world = World(configs, envoy, controller, schedule, warmup=warmup, duration=duration,
                  tail=tail, addresses=addresses, tick_phase=(seed * 0.37) % 2.0)
    result = world.run()
    out = {"policy": policy, "seed": seed, **result.summary()}
    if trace:
        out["trace"] = result.trace
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(runs: list[dict[str, Any]], policies: list[str], seeds: list[int]) -> str:
    by = {(r["policy"], r["seed"]): r for r in runs}
    ref = next((p for p in policies if p.split()[0] == "reference"), None)
    lr = next((p for p in policies if p.split()[0] == "least_request"), None)
    cs = next((p for p in policies if p.split()[0] == "cswrr_orca"), None)
    lines = ["| policy | P50 | P99 | tok/s | P99/ref min/med/max | P99/cswrr med | P50/LR med "
             "| tok/s/LR med | unfinished |", "|---|---|---|---|---|---|---|---|---|"]

    def med(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    def f(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    for p in policies:
        rs = [by[(p, s)] for s in seeds if (p, s) in by]
        p99r = [_ratio(r["ttft_p99"], by.get((ref, r["seed"]), {}).get("ttft_p99")) for r in rs]
        p99c = [_ratio(r["ttft_p99"], by.get((cs, r["seed"]), {}).get("ttft_p99")) for r in rs]
        p50l = [_ratio(r["ttft_p50"], by.get((lr, r["seed"]), {}).get("ttft_p50")) for r in rs]
        tokl = [_ratio(r["output_tokens_per_s"],
                       by.get((lr, r["seed"]), {}).get("output_tokens_per_s")) for r in rs]
        vals = sorted(x for x in p99r if x is not None)
        spread = (f"{vals[0]:.2f}/{statistics.median(vals):.2f}/{vals[-1]:.2f}" if vals else "-")
        lines.append(
            f"| {p} | {f(med([r['ttft_p50'] for r in rs]), '.3f')} | "
            f"{f(med([r['ttft_p99'] for r in rs]))} | {f(med([r['output_tokens_per_s'] for r in rs]), '.0f')} | "
            f"{spread} | {f(med(p99c))} | {f(med(p50l))} | {f(med(tokl))} | "
            f"{sum(r['unfinished'] for r in rs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trimtab_dev.lab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--seeds", type=_seeds, default=[1, 2, 3])
    p.add_argument("--policy", action="append", dest="policies", required=True)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=6.0)
    p.add_argument("--tail", type=float, default=30.0)
    p.add_argument("--rate", type=float)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--trace", action="store_true", help="keep each tick's weights in the JSON")
    p.add_argument("--out")
    a = p.parse_args(argv)
    for policy in a.policies:
        parse_policy(policy)
    jobs = [(a.fleet, a.workload, pol, s, a.warmup, a.duration, a.tail, a.rate, a.trace)
            for s in a.seeds for pol in a.policies]
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        runs = list(pool.map(run_one, jobs))
    print(table(runs, a.policies, a.seeds))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"args": vars(a), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
