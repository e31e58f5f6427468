"""Benchmark: one PromQL tick for a 10,000-endpoint pool, without the network.

Builds realistic ``/api/v1/query`` answers (one per default signal, 10,000 series each),
then times, per tick: parsing them (``parse_vector``), merging them per address
(``merge_answers``), and computing composite weights (``compute_composite_weights``, fed
the previous tick's weights as a controller would). Prints the figures and writes them to
``benchmarks/results/promql_ingest.json``.

    .venv/bin/python benchmarks/promql_ingest.py [--endpoints 10000] [--ticks 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from weight_calculator.composite import (
    CompositePolicy,
    EndpointInput,
    Signals,
    compute_composite_weights,
)
from weight_calculator.types import PoolWeights
from xds_server.promql import PromQLResult, default_queries, merge_answers, parse_vector

RESULTS = Path(__file__).parent / "results" / "promql_ingest.json"
NOW = 1_796_123_661.0
RANGES = {
    "kv_usage": (0.0, 1.0),
    "queue": (0.0, 40.0),
    "running": (0.0, 64.0),
    "itl_ms": (5.0, 120.0),
    "gpu_mem_pct": (80.0, 95.0),
}


def address(i: int) -> str:
    return f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000"


def answer(signal: str, endpoints: int, rng: random.Random) -> str:
    lo, hi = RANGES[signal]
    result = [
        {"metric": {"instance": address(i)}, "value": [NOW, repr(rng.uniform(lo, hi))]}
        for i in range(endpoints)
    ]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def one_tick(
    bodies: dict[str, str], policy: CompositePolicy, previous: PoolWeights | None
) -> tuple[dict[str, float], PoolWeights]:
    t0 = time.perf_counter()
    parsed = {signal: parse_vector(body, "instance") for signal, body in bodies.items()}
    t1 = time.perf_counter()
    merged: PromQLResult = merge_answers(parsed)
    inputs = {
        addr: EndpointInput(Signals.from_mapping(values), collected_at=NOW)
        for addr, values in merged.values.items()
    }
    t2 = time.perf_counter()
    weights = compute_composite_weights(inputs, policy, NOW + 0.5, previous)
    t3 = time.perf_counter()
    timings = {"parse_ms": t1 - t0, "merge_ms": t2 - t1, "weights_ms": t3 - t2, "total_ms": t3 - t0}
    return {k: v * 1000.0 for k, v in timings.items()}, weights


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in samples[0]:
        values = sorted(s[key] for s in samples)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        out[key] = {"median": statistics.median(values), "p95": p95, "max": values[-1]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=10_000)
    parser.add_argument("--ticks", type=int, default=30)
    args = parser.parse_args()
    rng = random.Random(42)
    bodies = {signal: answer(signal, args.endpoints, rng) for signal in default_queries()}
    policy, previous, samples = CompositePolicy(), None, []
    for _ in range(args.ticks + 2):
        timing, previous = one_tick(bodies, policy, previous)
        samples.append(timing)
    samples = samples[2:]  # first two ticks warm up (and build the EWMA history)
    report = {
        "endpoints": args.endpoints,
        "signals": len(bodies),
        "ticks": args.ticks,
        "answer_bytes_per_signal": len(next(iter(bodies.values()))),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "timings_ms": summarise(samples),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.endpoints} endpoints x {len(bodies)} signals, {args.ticks} ticks")
    print(f"answer size per signal: {report['answer_bytes_per_signal'] / 1e6:.2f} MB")
    for key, stats in report["timings_ms"].items():
        print(
            f"  {key:<11} median {stats['median']:8.1f}  p95 {stats['p95']:8.1f}  max {stats['max']:8.1f}"
        )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
