"""Benchmark: tail latency with and without request tiers on a simulated fleet (issue 16).

The same four simulated H100 servers and the same seeded workload through a real Envoy and
``trimtab serve``, two ways:

* ``tiers``: a text pool (2 x Llama-3.1-8B), a vision-language pool (1 x Qwen2-VL-7B, profile
  ``qwen2-vl-7b``, serving the same model name) and a long-generation pool (1 x Llama-3.1-8B)
  behind one listener; request classes send image requests to the VL pool and
  ``max_tokens >= 1024`` to the long-generation pool;
* ``one-pool``: all four servers in one pool (least_request, trimtab's weights), every request
  anywhere (the simulator serves any request on any server).

Workload: 70 % short streamed chats, 15 % chats with an image part, 15 % long generations
(1024..1536 tokens), Poisson at ``--rate`` for ``--duration`` s per variant and seed. Reports
per class TTFT p50/p99, TPOT p99 (inter-token time) and end-to-end p99, and the ratios
tiers / one-pool, per seed and their spread. Writes ``benchmarks/results/tiers.json``.

    trimtab bench tiers [--duration 15] [--rate 8] [--seeds 1,2] [--output PATH]

(``benchmarks/tiers.py`` runs the same.) Exit status: 0 when every run finished, 1 when a
process could not start, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from trimtab_dev.bench.processes import (
    READY_TIMEOUT_S,
    BenchError,
    ChildProcess,
    cli_command,
    http_json,
    wait_until,
)
from trimtab_dev.envoy_process import EnvoyError, EnvoyProcess, free_port, render_bootstrap
from trimtab_dev.loadgen.report import distribution
from trimtab_dev.loadgen.runner import RequestRecord, run_load
from trimtab_dev.loadgen.workload import parse_workload
from trimtab_dev.sim.fleet import SimFleet

RESULTS = Path("benchmarks") / "results" / "tiers.json"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TEXT = {"model": MODEL, "servers": [{"name": "text", "gpu": "H100-80G", "count": 2},
                                    {"name": "long", "gpu": "H100-80G"}]}
VL = {"model": MODEL, "model_profile": "qwen2-vl-7b",
      "servers": [{"name": "vl", "gpu": "H100-80G"}]}
LONG_MIN = 1024
CLASSES = [
    {"name": "chat", "weight": 0.70, "prompt_tokens": {"dist": "loguniform", "min": 200,
                                                       "max": 1500},
     "max_tokens": {"dist": "uniform", "min": 64, "max": 256}},
    {"name": "image", "weight": 0.15, "images": 1,
     "prompt_tokens": {"dist": "loguniform", "min": 400, "max": 1200},
     "max_tokens": {"dist": "uniform", "min": 64, "max": 256}},
    {"name": "long-generation", "weight": 0.15,
     "prompt_tokens": {"dist": "loguniform", "min": 200, "max": 800},
     "max_tokens": {"dist": "uniform", "min": LONG_MIN, "max": 1536}},
]


def trimtab_config(variant: str, text: dict[str, str], vl: dict[str, str],
                   ports: dict[str, int]) -> dict[str, Any]:
    def pool(name: str, addresses: list[str], **extra: Any) -> dict[str, Any]:
        return {"name": name, "model": MODEL,
                "endpoints": [{"address": a} for a in addresses], **extra}

    if variant == "tiers":
        classes = [{"pool": "chat-vl", "modality": "image"},
                   {"pool": "chat-long", "max_tokens": {"min": LONG_MIN}}]
        pools = [pool("chat", [text["text-0"], text["text-1"]], request_classes=classes),
                 pool("chat-vl", [vl["vl"]]), pool("chat-long", [text["long"]])]
    else:
        pools = [pool("chat", [text["text-0"], text["text-1"], text["long"], vl["vl"]])]
    return {"xds": {"address": f"127.0.0.1:{ports['xds']}"},
            "admin": {"address": f"127.0.0.1:{ports['admin']}"},
            "listener": {"address": f"127.0.0.1:{ports['listener']}"},
            "telemetry": {"interval_seconds": 1.0},
            "weights": {"policy": "composite"},
            "pools": pools}


async def run_variant(variant: str, seed: int, rate: float, duration: float,
                      workdir: Path) -> list[RequestRecord]:
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    workload = parse_workload({"name": "tiers", "seed": seed, "rate": rate,
                               "duration_s": duration, "stream": True,
                               "models": [{"name": MODEL}], "classes": CLASSES,
                               "realistic_bodies": True, "timeout_s": 120})
    async with SimFleet(TEXT) as text, SimFleet(VL) as vl:
        path = workdir / f"{variant}-{seed}.yaml"
        path.write_text(yaml.safe_dump(trimtab_config(variant, text.addresses, vl.addresses,
                                                      ports)))
        trimtab = ChildProcess("trimtab serve", cli_command(
            "--log-level", "warning", "serve", "--config", str(path)),
            workdir / f"{variant}-{seed}.log")
        envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
        try:
            trimtab.start()
            await asyncio.to_thread(
                wait_until, lambda: http_json(f"http://127.0.0.1:{ports['admin']}/readyz", 0.5)
                is not None, READY_TIMEOUT_S, "trimtab /readyz", trimtab.check_alive)
            envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                         admin_port=ports["envoy_admin"], api="delta"),
                        workdir / f"{variant}-{seed}-envoy.log")
            await asyncio.to_thread(envoy.wait_ready, 15.0)
            await asyncio.sleep(2.0)  # a few ticks: weights from telemetry
            result = await run_load([f"http://127.0.0.1:{ports['listener']}"], workload)
        finally:
            await asyncio.to_thread(envoy.stop)
            await asyncio.to_thread(trimtab.stop)
    return result.records


def per_class(records: list[RequestRecord]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in sorted({r.cls for r in records}):
        group = [r for r in records if r.cls == cls]
        ok = [r for r in group if r.served]
        out[cls] = {"count": len(group), "errors": len(group) - len(ok),
                    "servers": sorted({str(r.server) for r in ok}),
                    "ttft_s": distribution(r.ttft for r in ok),
                    "tpot_s": distribution(r.tpot for r in ok),
                    "e2e_s": distribution(r.e2e for r in ok)}
    return out


def _ratio(tiers: dict[str, Any], flat: dict[str, Any], cls: str, metric: str,
           q: str) -> float | None:
    a, b = tiers[cls][metric][q], flat[cls][metric][q]
    return a / b if a and b else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trimtab bench tiers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        seeds = []
    runs: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    if not seeds or args.duration <= 0 or args.rate <= 0:
        print("trimtab bench tiers: --seeds, --duration and --rate must be given and > 0",
              file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="trimtab-tiers-") as tmp:
            for seed in seeds:
                for variant in ("tiers", "one-pool"):
                    records = asyncio.run(run_variant(variant, seed, args.rate, args.duration,
                                                      Path(tmp)))
                    runs.setdefault(str(seed), {})[variant] = per_class(records)
    except (BenchError, EnvoyError, OSError) as exc:
        print(f"trimtab bench tiers: {exc}", file=sys.stderr)
        return 1
    ratios: dict[str, dict[str, list[float]]] = {}
    print(f"per class, seeds {seeds}, {args.rate} req/s for {args.duration} s "
          f"({time.monotonic() - started:.0f} s wall):")
    for seed_name, variants in runs.items():
        for variant, classes in variants.items():
            for cls, entry in classes.items():
                ttft, tpot, e2e = entry["ttft_s"], entry["tpot_s"], entry["e2e_s"]
                print(f"  seed {seed_name} {variant:8s} {cls:16s} n={entry['count']:3d} "
                      f"err={entry['errors']} TTFT p50 {_ms(ttft['p50'])} p99 {_ms(ttft['p99'])}"
                      f"  TPOT p99 {_ms(tpot['p99'])}  e2e p99 {_s(e2e['p99'])}  "
                      f"on {','.join(entry['servers'])}")
        for cls in variants["tiers"]:
            for metric, q in (("ttft_s", "p99"), ("tpot_s", "p99"), ("e2e_s", "p99")):
                value = _ratio(variants["tiers"], variants["one-pool"], cls, metric, q)
                if value is not None:
                    ratios.setdefault(cls, {}).setdefault(f"{metric}_{q}", []).append(value)
    print("\ntiers / one-pool (median over seeds [min..max]; below 1: tiers better):")
    spread: dict[str, Any] = {}
    for cls, metrics in ratios.items():
        for metric, values in metrics.items():
            spread.setdefault(cls, {})[metric] = {"median": statistics.median(values),
                                                  "min": min(values), "max": max(values)}
            print(f"  {cls:16s} {metric:10s} {statistics.median(values):.2f} "
                  f"[{min(values):.2f}..{max(values):.2f}]")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"benchmark": "tiers", "rate": args.rate,
                                       "duration_s": args.duration, "seeds": seeds,
                                       "ratios": spread, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


def _ms(value: float | None) -> str:
    return f"{value * 1000:7.1f} ms" if value is not None else "      -"


def _s(value: float | None) -> str:
    return f"{value:6.2f} s" if value is not None else "     -"


if __name__ == "__main__":
    sys.exit(main())
