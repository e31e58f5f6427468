"""`trimtab sim`: serve a fleet of simulated vLLM servers until SIGINT/SIGTERM.

Once every server listens, one JSON line goes to stdout:
``{"event": "ready", "pid": ..., "servers": [{"name", "gpu", "address", "url", "dead",
"kv_capacity_tokens"}, ...]}`` (also written to ``--ready-file`` if given), so a parent
process can read the addresses. ``--estimate-capacity WORKLOAD.yaml`` instead prints each
server's saturated throughput for that workload's request mix (virtual time, no sockets).

Exit status: 0 after a clean stop, 1 when a port cannot be bound, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trimtab_dev.sim.engine import estimate_capacity
from trimtab_dev.sim.fleet import FleetError, FleetSpec, SimFleet, expand, load_fleet

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trimtab sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", required=True, help="fleet YAML")
    p.add_argument("--ready-file", help="also write the ready line to this file")
    p.add_argument("--estimate-capacity", metavar="WORKLOAD",
                   help="print saturated throughput per server for this workload and exit")
    p.add_argument("--samples", type=int, default=2000,
                   help="requests drawn for --estimate-capacity (default 2000)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    return p


async def _serve(spec: FleetSpec, ready_file: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        fleet = SimFleet(spec)
        await fleet.start()
    except OSError as exc:
        print(f"trimtab sim: cannot start: {exc}", file=sys.stderr)
        return 1
    gc.freeze()  # startup objects never die: keep them out of every later collection
    try:
        line = json.dumps({"event": "ready", "pid": fleet.stats()["pid"],
                           "servers": fleet.describe()})
        print(line, flush=True)
        if ready_file:
            Path(ready_file).write_text(line + "\n")
        await stop.wait()
    finally:
        await fleet.close()
    return 0


def capacity_table(spec: FleetSpec, workload_path: str, samples: int) -> dict[str, Any]:
    """Saturated req/s and output tokens/s per server, and the fleet's sum."""
    from trimtab_dev.loadgen.workload import load_workload, request_samples

    workload = load_workload(workload_path)
    pairs = request_samples(workload, samples)
    rows: list[dict[str, Any]] = []
    cache: dict[tuple[Any, float], tuple[float, float]] = {}
    for config in expand(spec):
        key = (config.gpu, config.faults.slow)
        if key not in cache:
            eff = config.efficiency
            cap = estimate_capacity(config.gpu, config.model, pairs, eff)
            cache[key] = (cap.req_per_s / config.faults.slow,
                          cap.output_tokens_per_s / config.faults.slow)
        rps, tps = (0.0, 0.0) if config.faults.dead else cache[key]
        rows.append({"name": config.name, "gpu": config.gpu.name, "req_per_s": rps,
                     "output_tokens_per_s": tps})
    total = float(sum(r["req_per_s"] for r in rows))
    return {"workload": workload.name, "samples": samples, "servers": rows,
            "total_req_per_s": total, "workload_rate": workload.rate,
            "workload_load_fraction": workload.rate / total if total else None}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        spec = load_fleet(args.fleet)
        if args.estimate_capacity:
            print(json.dumps(capacity_table(spec, args.estimate_capacity, args.samples),
                             indent=2))
            return 0
    except (FleetError, ValueError) as exc:
        print(f"trimtab sim: invalid input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return asyncio.run(_serve(spec, args.ready_file))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
