"""Benchmark: one PromQL tick for a 10,000-endpoint pool, without the network.

Builds realistic ``/api/v1/query`` answers (one per default signal, 10,000 series each),
then times, per tick: parsing them (``parse_vector``), merging them per address
(``merge_answers``, then ``EndpointInput``/``Signals.from_mapping`` as a controller does),
and computing composite weights (``compute_composite_weights``, fed the previous tick's
weights as a controller would). Prints per-phase medians and whether the tick meets the
target (200 ms at 10,000 endpoints, parsing included), and writes them to
``benchmarks/results/promql_ingest.json``.

``--baseline REV`` also loads ``composite.py`` and ``promql.py`` as they were at git revision
``REV`` and runs their ticks interleaved with the current code's, in the same process, so a
before/after comparison sees the same machine load (this machine is shared and noisy).

    .venv/bin/python benchmarks/promql_ingest.py [--endpoints 10000] [--ticks 30]
    .venv/bin/python benchmarks/promql_ingest.py --baseline a97e2ce
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from weight_calculator import composite
from weight_calculator.types import PoolWeights
from xds_server.telemetry import promql

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "promql_ingest.json"
TARGET_MS = 200.0  # per tick at 10,000 endpoints, parsing included (the telemetry issue)
NOW = 1_796_123_661.0
RANGES = {
    "kv_usage": (0.0, 1.0),
    "queue": (0.0, 40.0),
    "running": (0.0, 64.0),
    "itl_ms": (5.0, 120.0),
    "gpu_mem_pct": (80.0, 95.0),
}
PHASES = ("parse_ms", "merge_ms", "weights_ms", "total_ms")


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
    bodies: dict[str, str],
    policy: Any,
    previous: PoolWeights | None,
    code: tuple[ModuleType, ModuleType] = (composite, promql),
) -> tuple[dict[str, float], PoolWeights]:
    """One tick through ``code`` = (composite module, promql module)."""
    weights_mod, promql_mod = code
    t0 = time.perf_counter()
    parsed = {signal: promql_mod.parse_vector(body, "instance") for signal, body in bodies.items()}
    t1 = time.perf_counter()
    merged = promql_mod.merge_answers(parsed)
    make_input, from_mapping = weights_mod.EndpointInput, weights_mod.Signals.from_mapping
    inputs = {
        addr: make_input(from_mapping(values), collected_at=NOW)
        for addr, values in merged.values.items()
    }
    t2 = time.perf_counter()
    weights = weights_mod.compute_composite_weights(inputs, policy, NOW + 0.5, previous)
    t3 = time.perf_counter()
    timings = (t1 - t0, t2 - t1, t3 - t2, t3 - t0)
    return {key: value * 1000.0 for key, value in zip(PHASES, timings, strict=True)}, weights


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in samples[0]:
        values = sorted(s[key] for s in samples)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        out[key] = {"median": statistics.median(values), "p95": p95, "max": values[-1]}
    return out


def load_baseline(rev: str) -> tuple[ModuleType, ModuleType]:
    """``composite.py`` and ``promql.py`` as of git revision ``rev``, as separate modules."""
    folder = Path(tempfile.mkdtemp(prefix="promql_ingest_baseline_"))
    loaded = []
    for name, path in (
        ("baseline_composite", "weight_calculator/composite.py"),
        ("baseline_promql", "xds_server/telemetry/promql.py"),
    ):
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        (folder / f"{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while being built
        spec.loader.exec_module(module)
        loaded.append(module)
    return loaded[0], loaded[1]


def run(
    bodies: dict[str, str], ticks: int, variants: dict[str, tuple[ModuleType, ModuleType]]
) -> dict[str, list[dict[str, float]]]:
    """Tick every variant in turn (alternating which goes first); two warm-up ticks each."""
    policies = {name: code[0].CompositePolicy() for name, code in variants.items()}
    previous: dict[str, PoolWeights | None] = dict.fromkeys(variants)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    order = list(variants)
    for tick in range(ticks + 2):
        for name in order if tick % 2 == 0 else reversed(order):
            timing, previous[name] = one_tick(
                bodies, policies[name], previous[name], variants[name]
            )
            if tick >= 2:  # the first two ticks warm up (and build the EWMA history)
                samples[name].append(timing)
    weights = [w for w in previous.values() if w is not None]
    assert all(w == weights[0] for w in weights[1:]), "variants disagree on the weights"
    return samples


def report_lines(name: str, stats: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"{name}:"]
    for key, s in stats.items():
        lines.append(
            f"  {key:<11} median {s['median']:8.1f}  p95 {s['p95']:8.1f}  max {s['max']:8.1f}"
        )
    total = stats["total_ms"]["median"]
    verdict = "met" if total <= TARGET_MS else "NOT met"
    lines.append(f"  target: total median {total:.1f} ms <= {TARGET_MS:g} ms: {verdict}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=10_000)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--baseline", metavar="REV", help="also time the code at git REV")
    args = parser.parse_args()
    rng = random.Random(42)
    bodies = {signal: answer(signal, args.endpoints, rng) for signal in promql.default_queries()}
    variants = {"current": (composite, promql)}
    if args.baseline:
        variants = {f"baseline {args.baseline}": load_baseline(args.baseline), **variants}
    stats = {name: summarise(s) for name, s in run(bodies, args.ticks, variants).items()}
    current = stats["current"]
    report: dict[str, Any] = {
        "endpoints": args.endpoints,
        "signals": len(bodies),
        "ticks": args.ticks,
        "answer_bytes_per_signal": len(next(iter(bodies.values()))),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "target_total_ms": TARGET_MS,
        "target_met": current["total_ms"]["median"] <= TARGET_MS,
        "timings_ms": current,
    }
    if args.baseline:
        report["baseline"] = {
            "rev": args.baseline,
            "timings_ms": stats[f"baseline {args.baseline}"],
        }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.endpoints} endpoints x {len(bodies)} signals, {args.ticks} ticks")
    print(f"answer size per signal: {report['answer_bytes_per_signal'] / 1e6:.2f} MB")
    for name, variant_stats in stats.items():
        print("\n".join(report_lines(name, variant_stats)))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
