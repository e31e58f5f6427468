"""xDS fan-out over replicas: R trimtab servers with the same inputs, the clients split evenly.

    .venv/bin/python -m benchmarks.xds_fanout_replicas                 # 1 x 1,000 vs 2 x 500
    .venv/bin/python -m benchmarks.xds_fanout_replicas --repeats 3 --api delta

Each replica is the server process of `benchmarks/xds_fanout.py` (the production servicer and
gRPC options, resources from the real `Controller.resources()`), all with the same seed, so
they build byte-identical snapshots with identical versions, as replicas with the same
telemetry do (checked every tick: every replica must announce the same CLA versions). The
clients run in `--workers` processes in every layout (worker k talks to replica k % R), so the
client side costs the same whatever R is. Each tick every replica publishes the same
snapshot; a replica's tick latency is the last of *its* clients' times minus *its* publish.
Per replica: CPU cores over the tick phase, tick p50/p99, peak RSS. Results: a table on stdout
and `benchmarks/results/xds_fanout_replicas.json`. Layouts alternate within a repeat, so
the box's changing load falls on both alike; read the spread between repeats.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.fanout_client import WorkerSpec, raise_fd_limit, worker_main
from benchmarks.xds_fanout import (
    Fleet,
    ServerSpec,
    _ask,
    _start,
    _stop,
    _tick_latency,
    percentile,
    server_main,
    write_results,
)

RESULTS = Path(__file__).resolve().parent / "results" / "xds_fanout_replicas.json"


@dataclass
class Layout:
    api: str
    replicas: int
    clients: int  # in all
    pools: int
    endpoints_per_pool: int
    workers: int = 2
    ticks: int = 6
    interval: float = 2.0
    fraction: float = 0.10
    settle_s: float = 10.0


def _specs(layout: Layout, ports: list[int]) -> list[WorkerSpec]:
    specs = [WorkerSpec(f"127.0.0.1:{ports[k % layout.replicas]}", [])
             for k in range(layout.workers)]
    for index in range(layout.clients):
        specs[index % layout.workers].clients.append((f"envoy-{index:05d}", layout.api))
    return specs


def run_layout(layout: Layout) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    servers = [_start(server_main, ServerSpec(layout.pools, layout.endpoints_per_pool,
                                              layout.fraction, seed=1))
               for _ in range(layout.replicas)]
    hellos = [conn.recv() for _, conn in servers]
    ports = [hello[1] for hello in hellos]
    initial = hellos[0][3]
    assert all(h[3]["keys"] == initial["keys"] for h in hellos), "replicas disagree"
    workers = [_start(worker_main, spec) for spec in _specs(layout, ports)]
    fleet = Fleet([conn for _, conn in workers])
    for conn in fleet.conns:
        conn.recv()  # ready
    try:
        row = _measure(layout, [conn for _, conn in servers], fleet, initial)
        row["loadavg_1m_before"] = load_before
        return row
    finally:
        _stop(fleet.conns, [p for p, _ in workers])
        _stop([conn for _, conn in servers], [p for p, _ in servers])


def _measure(layout: Layout, servers: list[Any], fleet: Fleet, initial: dict[str, Any]
             ) -> dict[str, Any]:
    fleet.command(("expect", 0, initial["keys"]))
    go = time.monotonic()
    fleet.command(("go",))
    storm_ok = fleet.wait_ticks(range(1), go + 60.0)
    start = [_ask(conn, ("mark",))[1] for conn in servers]
    published: list[list[float]] = [[] for _ in servers]
    first = time.monotonic() + 0.2
    for tick in range(1, layout.ticks + 1):
        fleet.sleep_until(first + (tick - 1) * layout.interval)
        prepared = [_ask(conn, ("prepare",))[1] for conn in servers]
        assert all(p["keys"] == prepared[0]["keys"] for p in prepared), "replicas disagree"
        fleet.command(("expect", tick, prepared[0]["keys"]))
        for index, conn in enumerate(servers):
            published[index].append(_ask(conn, ("publish",))[1])
    fleet.sleep_until(max(p[-1] for p in published) + layout.interval)
    end = [_ask(conn, ("mark",))[1] for conn in servers]
    settled = fleet.wait_ticks(range(layout.ticks + 1),
                               max(p[-1] for p in published) + layout.settle_s)
    reports = [reply[1] for reply in fleet.command(("report",))]
    return _summarize(layout, published, start, end, reports, storm_ok and settled)


def _summarize(layout: Layout, published: list[list[float]], start: list[dict[str, Any]],
               end: list[dict[str, Any]], reports: list[dict[str, Any]], settled: bool
               ) -> dict[str, Any]:
    per_replica = []
    for index in range(layout.replicas):
        mine = [r for k, r in enumerate(reports) if k % layout.replicas == index]
        latencies = [_tick_latency([t for r in mine for t in r["done"][tick]],
                                   published[index][tick - 1])
                     for tick in range(1, layout.ticks + 1)]
        wall = end[index]["wall"] - start[index]["wall"]
        per_replica.append({
            "streams": end[index]["streams"],
            "cpu_cores": (end[index]["cpu_s"] - start[index]["cpu_s"]) / wall,
            "loop_thread_cores": (end[index]["threads"].get("main", 0.0)
                                  - start[index]["threads"].get("main", 0.0)) / wall,
            "tick_p50_s": percentile(latencies, 50), "tick_p99_s": percentile(latencies, 99),
            "tick_latencies_s": latencies, "peak_rss_mb": end[index]["peak_rss_mb"],
            "pushed_mb_per_tick": (sum(end[index]["pushed_bytes"].values())
                                   - sum(start[index]["pushed_bytes"].values()))
            / layout.ticks / 2**20})
    return {**asdict(layout), "endpoints": layout.pools * layout.endpoints_per_pool,
            "per_replica": per_replica,
            "cpu_cores_total": sum(r["cpu_cores"] for r in per_replica),
            "cpu_cores_max_replica": max(r["cpu_cores"] for r in per_replica),
            "tick_p50_s_worst_replica": max(r["tick_p50_s"] for r in per_replica),
            "tick_p99_s_worst_replica": max(r["tick_p99_s"] for r in per_replica),
            "stream_failures": sum(r["failures"] for r in reports),
            "error_count": sum(len(r["errors"]) for r in reports), "settled": settled}


def line(row: dict[str, Any]) -> str:
    replicas = "; ".join(f"{r['streams']} streams {r['cpu_cores']:.2f} cores "
                         f"(loop {r['loop_thread_cores']:.2f}) tick p50 {r['tick_p50_s']:.3f} "
                         f"p99 {r['tick_p99_s']:.3f} s RSS {r['peak_rss_mb']:.0f} MB"
                         for r in row["per_replica"])
    return (f"{row['api']} {row['replicas']} x {row['clients'] // row['replicas']} "
            f"({row['endpoints']} endpoints): total {row['cpu_cores_total']:.2f} cores | "
            f"{replicas} | retries {row['stream_failures']} errors {row['error_count']} "
            f"load {row['loadavg_1m_before']:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=("sotw", "delta"), default="sotw")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pools", type=int, default=100)
    parser.add_argument("--endpoints-per-pool", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2, help="client processes, every layout")
    parser.add_argument("--ticks", type=int, default=6)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    raise_fd_limit()
    rows = []
    for repeat in range(args.repeats):
        for replicas in args.replicas:
            row = run_layout(Layout(args.api, replicas, args.clients, args.pools,
                                    args.endpoints_per_pool, args.workers, args.ticks,
                                    args.interval))
            row["repeat"] = repeat
            rows.append(row)
            print(line(row), flush=True)
    write_results({f"{args.api}_{args.clients}": rows,
                   "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}},
                  RESULTS)
    print(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
