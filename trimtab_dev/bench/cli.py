"""`trimtab bench`: the same workload through a real Envoy with each balancing policy.

    trimtab bench --fleet examples/fleet-hetero.yaml --workload examples/workload-mixed.yaml \\
        --policies round_robin,least_request,cswrr_orca,reference,trimtab --duration 120 \\
        --seeds 42,1,2 --out benchmarks/results/bench-hetero
    trimtab bench tiers --duration 15 --rate 14 --seeds 1,2   # request tiers (issue 16)

Starts the simulated fleet once (``trimtab sim``), then per policy: Envoy (static config for
the baselines; ADS from ``trimtab serve`` for trimtab and for the reference controller), waits until Envoy routes to every
host, runs the workload (same seed, an unmeasured warm-up first), and waits for the fleet to
drain before the next policy. Prints the comparison and writes DIR/bench.json, DIR/bench.png,
DIR/records-<policy>.jsonl and every process's log and config. With ``--seeds`` it does all
that once per seed in DIR/seed-<S>/, then prints and writes the spread of every ratio
(DIR/spread.json: min/median/max across seeds). ``--report-only --out DIR`` recomputes the
summaries, tables, spread and figures from the records without running anything.

The targets: the issue's on a heterogeneous fleet; on a homogeneous one (every live server
identical, or ``--targets homogeneous``) "trimtab no worse than least_request within
``--tolerance``" (P99 TTFT and output tokens/s).

Exit status: 0 when every policy ran, 1 when something could not start or was interrupted,
2 on bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from types import FrameType
from typing import Any

from trimtab_dev.bench import envoy_configs, reference, report, spread, surge
from trimtab_dev.bench.envoy_configs import LongContext
from trimtab_dev.bench.fleet import Fleet, SimFleetProcess
from trimtab_dev.bench.options import (
    LONG_POOL_KV_FACTOR,
    BenchSettings,
    build_parser,
    settings_from,
)
from trimtab_dev.bench.processes import BenchError
from trimtab_dev.bench.runner import Counters, LoadPlan, LoadRun, measure
from trimtab_dev.bench.samplers import samplers_for
from trimtab_dev.bench.stack import PolicyStack
from trimtab_dev.envoy_process import EnvoyError, envoy_binary
from trimtab_dev.loadgen.runner import RequestRecord
from trimtab_dev.loadgen.workload import Workload, WorkloadError, load_workload
from trimtab_dev.sim.fleet import FleetError, load_fleet
from xds_server import __version__

EXIT_BAD_INPUT = 2
DRAIN_TIMEOUT_S = 180.0
PROGRESS_EVERY_S = 15.0


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


async def _progress(policy: str, counters: Counters, plan: LoadPlan) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        log(f"{policy}: {time.monotonic() - started:.0f}/{plan.total:.0f} s, sent "
            f"{counters.sent}, answered {counters.done}, in flight "
            f"{counters.sent - counters.done}, errors {counters.errors}, refused "
            f"{counters.refused}")


async def _measure(stack: PolicyStack, w: Workload, s: BenchSettings) -> LoadRun:
    counters = Counters()
    ticker = asyncio.create_task(_progress(stack.policy, counters, s.plan()))
    try:
        return await measure(stack.listener_url, w, s.plan(),
                             samplers_for(stack, s.interval), counters)
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)


def longest_request(w: Workload) -> int:
    """The most tokens one request of ``w`` can hold in KV: prompt plus output."""
    def top(d: Any) -> int:
        return int(d.value if d.dist == "fixed" else d.max)
    return max(top(c.prompt_tokens) + top(c.max_tokens) for c in w.classes)


def long_context_for(fleet: Fleet, w: Workload, tokens: int,
                     factor: float = LONG_POOL_KV_FACTOR) -> LongContext | None:
    """The long-context class for prompts of ``tokens`` or more: the servers whose KV cache
    holds ``factor`` of the workload's longest requests (a smaller one holds one or two and
    queues the rest). None when ``tokens`` is 0."""
    if not tokens:
        return None
    need = int(factor * longest_request(w))
    big = tuple(x.address for x in fleet.servers if x.kv_capacity_tokens >= need)
    if not big:
        raise BenchError(f"no server's KV cache holds {need} tokens for the long-context pool")
    return LongContext(min_prompt_bytes=4 * tokens, addresses=big)


def run_policy(policy: str, fleet: Fleet, w: Workload, s: BenchSettings) -> LoadRun:
    """One policy: its Envoy (and trimtab) up, the load, everything stopped by PID."""
    stack = PolicyStack(policy, fleet, Path(s.out), weights=s.weights, interval=s.interval,
                        composite=s.composite, lb_policy=s.lb_policy, queueing=s.queueing,
                        active_request_bias=s.active_request_bias, ttft_slo_s=w.ttft_slo_s,
                        tenant_header=w.tenants.header if w.tenants else None,
                        long_context="auto" if s.auto_classes else long_context_for(
                            fleet, w, s.long_context_tokens, s.long_context_kv_factor))
    try:
        stack.start()
        log(f"{policy}: Envoy routes to {len(fleet.servers)} hosts via "
            f"{stack.listener_url}; {s.warmup:g} s warm-up + {s.duration:g} s measured")
        return asyncio.run(_measure(stack, w, s))
    finally:
        stack.close()


def run_all(s: BenchSettings, w: Workload, model: str) -> dict[str, Any]:
    out = Path(s.out)
    sim = SimFleetProcess(s.fleet, model, out)
    entries: dict[str, Any] = {}
    ttfts: dict[str, list[float]] = {}
    records: dict[str, list[RequestRecord]] = {}
    try:
        fleet = sim.start()
        log(f"fleet up (pid {sim.child.pid}): " + ", ".join(
            f"{x.name}={x.address}" for x in fleet.servers))
        for policy in s.policies:
            drain = sim.wait_drained(DRAIN_TIMEOUT_S)
            run = run_policy(policy, fleet, w, s)
            entries[policy] = report.policy_entry(run, s.plan(), f"envoy:{policy}", fleet, drain)
            ttfts[policy] = report.ttft_values(run, s.plan())
            records[policy] = run.records
            report.write_records(run, out / f"records-{policy}.jsonl")
            log(f"{policy}: done, {run.unfinished} unfinished")
    finally:
        sim.stop()
    doc = {"config": _config(s, fleet), "seed": s.seed, "versions": versions(),
           "policies": entries,
           "comparison": report.comparison(entries, s.homogeneous, s.tolerance,
                                          s.auto_classes)}
    surge.add_surge(doc, records, s.plan())
    report.write_json(doc, out / "bench.json")
    if not report.write_png(doc, ttfts, out / "bench.png"):
        log("matplotlib is not installed: no bench.png (pip install matplotlib)")
    return doc


def _config(s: BenchSettings, fleet: Fleet) -> dict[str, Any]:
    return {**asdict(s), "policies": list(s.policies),
            "fleet_servers": [asdict(x) for x in fleet.servers], "model": fleet.model,
            "envoy": {"cluster": envoy_configs.CLUSTER,
                      "circuit_breakers": envoy_configs.CIRCUIT_LIMIT,
                      "route_timeout": "0s", "idle_timeout": envoy_configs.IDLE_TIMEOUT,
                      "cswrr": envoy_configs.CSWRR_SETTINGS},
            "trimtab": {"lb_policy": s.lb_policy, "weights": s.weights,
                        "queueing": s.queueing,
                        "interval_seconds": s.interval, "composite": s.composite,
                        "long_context_tokens": s.long_context_tokens,
                        "auto_classes": s.auto_classes,
                        "active_request_bias": s.active_request_bias,
                        "long_context_kv_factor": s.long_context_kv_factor},
            "reference": {"lb_policy": reference.LB_POLICY, "weights": reference.WEIGHTS,
                          "interval_seconds": reference.INTERVAL_S}}


def rereport(out: Path) -> dict[str, Any]:
    """Recompute every summary, the comparison and the figure from ``out``'s records."""
    doc = json.loads((out / "bench.json").read_text())
    c = doc["config"]
    plan = LoadPlan(c["rate"], c["warmup"], c["duration"], c["seed"], c["tail"])
    ttfts: dict[str, list[float]] = {}
    runs: dict[str, list[RequestRecord]] = {}
    for policy, entry in doc["policies"].items():
        records = runs[policy] = report.read_records(out / f"records-{policy}.jsonl")
        started = entry["summary"]["started_unix"] - plan.warmup
        run = LoadRun(records, plan.total, entry["client"], 0, started)
        entry["summary"] = report.policy_summary(run, plan, f"envoy:{policy}")
        ttfts[policy] = report.ttft_values(run, plan)
    doc["comparison"] = report.comparison(
        doc["policies"], bool(c.get("homogeneous", False)),
        float(c.get("tolerance", report.HOMOGENEOUS_TOLERANCE)),
        bool(c.get("auto_classes", False)))
    surge.add_surge(doc, runs, plan)
    report.write_json(doc, out / "bench.json")
    report.write_png(doc, ttfts, out / "bench.png")
    return doc


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"trimtab": __version__, "python": platform.python_version(),
                           "platform": platform.platform(), "cpus": os.cpu_count(),
                           "loadavg": list(os.getloadavg())}
    with contextlib.suppress(OSError, subprocess.SubprocessError, EnvoyError):
        text = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True,
                              timeout=10, check=False).stdout
        out["envoy"] = text.strip().split("version:")[-1].strip()
    for module in ("aiohttp", "matplotlib", "rich"):
        with contextlib.suppress(ImportError, AttributeError):
            out[module] = __import__(module).__version__
    return out


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_as_keyboard() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so every ``finally`` stops its children."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def seed_dirs(out: Path) -> dict[int, Path]:
    """``{seed: out/seed-<seed>}`` for the per-seed runs already in ``out``."""
    found = {}
    for path in sorted(out.glob("seed-*")):
        tail = path.name.removeprefix("seed-")
        if path.is_dir() and tail.lstrip("-").isdigit() and (path / "bench.json").exists():
            found[int(tail)] = path
    return found


def write_spread(docs: dict[int, dict[str, Any]], out: Path) -> dict[str, Any]:
    summary = spread.spread(docs)
    report.write_json(summary, out / "spread.json")
    spread.print_spread(summary)
    return summary


def report_only(out: Path) -> None:
    """Rebuild ``out`` (one run) or every ``out/seed-*`` run and their spread."""
    if (out / "bench.json").exists():
        report.print_report(rereport(out))
        return
    runs = seed_dirs(out)
    if not runs:
        raise ValueError(f"no bench.json in {out} nor in {out}/seed-*")
    docs = {seed: rereport(path) for seed, path in runs.items()}
    for doc in docs.values():
        report.print_report(doc)
    write_spread(docs, out)


def run_seeds(s: BenchSettings, w: Workload, model: str, seeds: Sequence[int]) -> None:
    """The whole comparison once per seed, each in ``out/seed-<seed>``, then the spread."""
    docs: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        one = replace(s, seed=seed, out=str(Path(s.out) / f"seed-{seed}"))
        Path(one.out).mkdir(parents=True, exist_ok=True)
        log(f"seed {seed} ({len(docs) + 1} of {len(seeds)}) into {one.out}")
        docs[seed] = run_all(one, w, model)
        report.print_report(docs[seed])
    write_spread(docs, Path(s.out))
    print(f"\nwrote {Path(s.out) / 'spread.json'} and seed-*/bench.json")


def run_bench(s: BenchSettings, w: Workload, model: str, seeds: Sequence[int] | None) -> int:
    Path(s.out).mkdir(parents=True, exist_ok=True)
    try:
        with interrupts_as_keyboard():
            if seeds:
                run_seeds(s, w, model, seeds)
                return 0
            doc = run_all(s, w, model)
    except (BenchError, EnvoyError, OSError) as exc:
        print(f"trimtab bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trimtab bench: interrupted; every process it started was stopped",
              file=sys.stderr)
        return 1
    report.print_report(doc)
    print(f"\nwrote {Path(s.out) / 'bench.json'} and {Path(s.out) / 'bench.png'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tiers"]:  # the scenario of issue 16: text, VL and long-generation pools
        from trimtab_dev.bench.tiers import main as tiers

        return tiers(argv[1:])
    args = build_parser().parse_args(argv)
    if args.report_only:
        try:
            report_only(Path(args.out))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"trimtab bench: cannot rebuild {args.out}: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return 0
    if not args.fleet or not args.workload or (args.seeds and args.seed is not None):
        print("trimtab bench: --fleet and --workload are required; --seed and --seeds "
              "exclude each other", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        w = load_workload(args.workload)
        if args.surge_start is not None:
            w = surge.with_start(w, args.surge_start)
        if args.ttft_slo is not None:
            if args.ttft_slo <= 0:
                raise ValueError("--ttft-slo must be > 0")
            w = w.model_copy(update={"ttft_slo_s": args.ttft_slo})
        spec = load_fleet(args.fleet)
        s = settings_from(args, w, spec)
    except (WorkloadError, FleetError, ValueError) as exc:
        print(f"trimtab bench: invalid input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run_bench(s, w, spec.model, args.seeds)


if __name__ == "__main__":
    raise SystemExit(main())
