"""xDS fan-out benchmark: N simulated Envoys (ADS, SotW or Delta) against one trimtab server.

    .venv/bin/python -m benchmarks.xds_fanout                       # 1,000 streams x 10,000 endpoints
    .venv/bin/python -m benchmarks.xds_fanout --api delta --clients 500 --pools 10
    .venv/bin/python -m benchmarks.xds_fanout --sweep               # largest N x M within 1 s
    .venv/bin/python -m benchmarks.xds_fanout --profile             # cProfile the server
    .venv/bin/python -m benchmarks.xds_fanout --sizes-only          # 50k-endpoint message sizes

Processes: the trimtab server (grpc.aio `XdsServicer` + `SnapshotCache`, resources built by the
real `Controller.resources()`) runs in its own process, so its CPU time and RSS are its own and
no benchmark bookkeeping shares its GIL; the clients (`benchmarks/fanout_client.py`) run in K
worker processes, many grpc.aio streams per event loop, one TCP connection per client; this
driver process only orchestrates over pipes and sleeps between ticks.

A run: start everything, connect every client at once (the reconnect storm: time until every
client holds CDS, every CLA, LDS and RDS), then every `--interval` seconds change `--fraction`
of the weights and `set_snapshot(build_snapshot(...))`. Before each publish the driver tells the
workers which CLA versions that tick changes; each client notes when it holds all of them
(a later version of a CLA counts too). Latency of a tick = last client's time - publish time
(CLOCK_MONOTONIC, the same clock in every process). Results: a table on stdout and
`benchmarks/results/xds_fanout.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import logging
import math
import multiprocessing as mp
import os
import pstats
import random
import resource
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, cast

from envoy.service.discovery.v3 import discovery_pb2
from prometheus_client import REGISTRY

from benchmarks.fanout_client import ENVOY_MAX_RECEIVE, WorkerSpec, raise_fd_limit, worker_main
from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.envoy.clusters import EndpointSetting
from xds_server.envoy.views import SnapshotViews
from xds_server.security.authz import NodeAuthorizer
from xds_server.security.guard import XdsGuard
from xds_server.security.limits import RateLimiter, server_options
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.nacks import NackLog
from xds_server.xds.protocol import DeltaStream, SotwStream
from xds_server.xds.server import XdsServicer, encode_delta, encode_sotw, start_xds_server
from xds_server.xds.snapshot import Snapshot, build_snapshot

RESULTS = Path(__file__).resolve().parent / "results" / "xds_fanout.json"
PROFILE_TXT = RESULTS.with_name("xds_fanout_profile.txt")
LATENCY_BOUND_S = 1.0
STORM_BOUND_S = 5.0
CPU_BOUND_CORES = 1.0
RSS_BOUND_MB = 1024.0
MAX_WEIGHT = 100


# --- the synthetic config and its snapshots (also used by tests/xds/test_fanout_faults.py) ------

def endpoint_address(index: int) -> str:
    return f"10.{(index >> 16) & 255}.{(index >> 8) & 255}.{index & 255}:8000"


def synthetic_config(pools: int, endpoints_per_pool: int) -> Config:
    """`pools` pools of `endpoints_per_pool` endpoints each, every address unique."""
    data = {"pools": [
        {"name": f"pool-{p:04d}", "model": f"model-{p:04d}", "lb_policy": "round_robin",
         "endpoints": [{"address": endpoint_address(p * endpoints_per_pool + e)}
                       for e in range(endpoints_per_pool)]}
        for p in range(pools)]}
    return parse_config(data)


class BenchController(Controller):
    """The real controller's resource building, fed weights by the benchmark, not telemetry."""

    bench_weights: dict[str, dict[str, int]]

    def settings(self) -> dict[str, dict[str, EndpointSetting]]:
        return {pool: {address: EndpointSetting(w) for address, w in weights.items()}
                for pool, weights in self.bench_weights.items()}


def random_weights(config: Config, rng: random.Random) -> dict[str, dict[str, int]]:
    return {pool.name: {ep.address: rng.randint(1, MAX_WEIGHT) for ep in pool.endpoints}
            for pool in config.pools}


def make_controller(config: Config, cache: SnapshotCache, seed: int = 1) -> BenchController:
    controller = BenchController(config, cache)
    controller.bench_weights = random_weights(config, random.Random(seed))
    return controller


def snapshot_of(controller: BenchController) -> Snapshot:
    return build_snapshot(controller.resources(), source=controller.view_inputs())


def change_weights(weights: dict[str, dict[str, int]], fraction: float,
                   rng: random.Random) -> int:
    """Give `fraction` of all endpoints a new (different) weight. Returns how many changed."""
    slots = [(pool, address) for pool, by_address in weights.items() for address in by_address]
    count = min(len(slots), max(1, round(fraction * len(slots))))
    for pool, address in rng.sample(slots, count):
        old = weights[pool][address]
        weights[pool][address] = rng.choice([w for w in (old - 7, old + 7, old % 50 + 1)
                                             if 1 <= w <= MAX_WEIGHT and w != old])
    return count


def cla_keys(snapshot: Snapshot, previous: Snapshot | None) -> dict[str, tuple[str, int]]:
    """name -> (version, CRC-32 of the payload) of every CLA that differs from `previous`."""
    old = previous.of_type(type_urls.ENDPOINT) if previous is not None else {}
    return {name: (res.version, zlib.crc32(res.payload))
            for name, res in snapshot.of_type(type_urls.ENDPOINT).items()
            if name not in old or old[name].version != res.version}


# --- the largest single response ---------------------------------------------------------------

def initial_response_sizes(snapshot: Snapshot) -> dict[str, int]:
    """Encoded size of the first response of each type to a fresh client (SotW and Delta), the
    largest a client gets: it carries every resource of the type at once."""
    sizes: dict[str, int] = {}
    for type_url in (type_urls.CLUSTER, type_urls.ENDPOINT):
        names = list(snapshot.of_type(type_url))
        sotw = SotwStream()
        sotw.receive(discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names))
        delta = DeltaStream()
        delta.receive(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url,
                                                          resource_names_subscribe=names))
        short = type_urls.short_name(type_url)
        sizes[f"sotw_{short}"] = sum(len(encode_sotw(r)) for r in sotw.responses(snapshot))
        sizes[f"delta_{short}"] = sum(len(encode_delta(r)) for r in delta.responses(snapshot))
    return sizes


def message_sizes(total_endpoints: int = 50_000) -> list[dict[str, Any]]:
    rows = []
    for pools in (1, 500):
        per_pool = total_endpoints // pools
        controller = make_controller(synthetic_config(pools, per_pool), SnapshotCache())
        snapshot = snapshot_of(controller)
        largest_cla = max(len(r.payload) for r in snapshot.of_type(type_urls.ENDPOINT).values())
        sizes = initial_response_sizes(snapshot)
        eds = max(sizes["sotw_eds"], sizes["delta_eds"])
        rows.append({"pools": pools, "endpoints_per_pool": per_pool, **sizes,
                     "largest_cla": largest_cla, "bytes_per_endpoint": eds / total_endpoints,
                     "endpoints_at_4mib": int(ENVOY_MAX_RECEIVE * total_endpoints / eds),
                     "over_4mib": eds > ENVOY_MAX_RECEIVE})
    return rows


# --- the server process ----------------------------------------------------------------------

@dataclass
class ServerSpec:
    pools: int
    endpoints_per_pool: int
    fraction: float
    seed: int = 1
    log_level: str = "info"  # trimtab's default: every push is logged (to /dev/null here)


def production_servicer(config: Config, cache: SnapshotCache
                        ) -> tuple[XdsServicer, dict[str, Any]]:
    """The servicer (guard: node authorisation, per-connection rate limit, per-node views; NACK
    log) and gRPC server options exactly as `xds_server.app.Trimtab` sets them up."""
    limits = config.xds.limits
    limiter = (RateLimiter(limits.requests_per_second, limits.request_burst)
               if limits.requests_per_second is not None else None)
    guard = XdsGuard(NodeAuthorizer.from_config(config.nodes), limiter, SnapshotViews())
    servicer = XdsServicer(cache, on_event=NackLog().observe, guard=guard)
    options = server_options(limits.max_streams_per_connection, limits.max_request_bytes,
                             limits.max_connection_age_seconds,
                             limits.max_connection_age_grace_seconds)
    return servicer, {"options": options, "maximum_concurrent_rpcs": limits.max_streams}


class FanoutServer:
    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.cache = SnapshotCache()
        config = synthetic_config(spec.pools, spec.endpoints_per_pool)
        self.controller = make_controller(config, self.cache, spec.seed)
        self.servicer, self.server_kwargs = production_servicer(config, self.cache)
        self.next: Snapshot | None = None
        self.profiler: cProfile.Profile | None = None

    def prepare(self) -> dict[str, Any]:
        """Change weights and build the next snapshot (not published yet)."""
        changed = change_weights(self.controller.bench_weights, self.spec.fraction, self.rng)
        started = time.perf_counter()
        self.next = snapshot_of(self.controller)
        build_s = time.perf_counter() - started
        return {"keys": cla_keys(self.next, self.cache.snapshot), "build_s": build_s,
                "weights_changed": changed}

    def publish(self) -> float:
        assert self.next is not None
        started = time.monotonic()
        self.cache.set_snapshot(self.next)
        return started

    def handle(self, command: tuple) -> tuple:
        if command[0] == "prepare":
            return ("prepared", self.prepare())
        if command[0] == "publish":
            return ("published", self.publish())
        if command[0] == "mark":
            return ("mark", process_stats(self.servicer))
        if command[0] == "profile":
            return ("profile", self.profile(command[1]))
        raise ValueError(f"unknown command {command!r}")

    def profile(self, action: str) -> str:
        if action == "start":
            self.profiler = cProfile.Profile()
            self.profiler.enable()
            return ""
        assert self.profiler is not None
        self.profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(self.profiler, stream=out)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(25)
        return out.getvalue()


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name ("main" is the event loop; gRPC's C++ threads are named by
    gRPC), from /proc: shows how much of the server's time is Python and how much gRPC core."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = "main" if task.name == str(os.getpid()) else stat[stat.index("(") + 1:
                                                                  stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def process_stats(servicer: XdsServicer) -> dict[str, Any]:
    cpu = os.times()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    pushed = {kind: REGISTRY.get_sample_value("trimtab_xds_pushed_bytes_total", {"type": kind})
              or 0.0 for kind in ("cds", "eds", "lds", "rds")}
    return {"cpu_s": cpu.user + cpu.system, "wall": time.monotonic(),
            "rss_mb": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
            "peak_rss_mb": usage.ru_maxrss / 1024, "pushed_bytes": pushed,
            "streams": len(servicer.streams), "threads": thread_cpu()}


def server_main(conn: Connection, spec: ServerSpec) -> None:
    raise_fd_limit()
    # trimtab's log format and level, written to /dev/null: its cost stays, its noise goes.
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - process lifetime
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=spec.log_level.upper(), handlers=[handler], force=True)
    asyncio.run(_serve(conn, spec))


async def _serve(conn: Connection, spec: ServerSpec) -> None:
    bench = FanoutServer(spec)
    initial = bench.prepare()
    bench.publish()
    server, port = await start_xds_server(bench.servicer, "127.0.0.1:0", **bench.server_kwargs)
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()
    loop.add_reader(conn.fileno(), lambda: inbox.put_nowait(conn.recv()))
    conn.send(("ready", port, os.getpid(), initial))
    try:
        while (command := await inbox.get())[0] != "stop":
            conn.send(bench.handle(command))
    finally:
        loop.remove_reader(conn.fileno())
        await server.stop(None)
        conn.send(("stopped",))


# --- the driver --------------------------------------------------------------------------------

@dataclass
class Scenario:
    api: str
    clients: int
    pools: int
    endpoints_per_pool: int
    workers: int = 1
    ticks: int = 10
    interval: float = 2.0
    fraction: float = 0.10
    profile: bool = False
    server_log_level: str = "info"
    settle_s: float = 10.0  # extra wait for the last tick (and for the storm: 60 s)


@dataclass
class Fleet:
    """The worker processes' pipes; `tick_done` collects their unsolicited notices."""

    conns: list[Connection]
    tick_done: dict[int, int] = field(default_factory=dict)

    def _next_reply(self, conn: Connection) -> tuple:
        while True:
            message = conn.recv()
            if message[0] != "tick_done":
                return message
            self.tick_done[message[1]] = self.tick_done.get(message[1], 0) + 1

    def command(self, command: tuple) -> list[tuple]:
        for conn in self.conns:
            conn.send(command)
        return [self._next_reply(conn) for conn in self.conns]

    def wait_ticks(self, ticks: range, deadline: float) -> bool:
        """Until every worker reported every tick in `ticks`, or `deadline`."""
        def complete() -> bool:
            return all(self.tick_done.get(t, 0) == len(self.conns) for t in ticks)

        while not complete() and time.monotonic() < deadline:
            self._read(deadline)
        return complete()

    def sleep_until(self, deadline: float) -> None:
        """Sleep, still reading the workers' notices."""
        while time.monotonic() < deadline:
            self._read(deadline)

    def _read(self, deadline: float) -> None:
        for conn in wait(self.conns, timeout=max(0.0, deadline - time.monotonic())):
            message = cast(Connection, conn).recv()
            if message[0] == "tick_done":
                self.tick_done[message[1]] = self.tick_done.get(message[1], 0) + 1


def _ask(conn: Connection, command: tuple) -> tuple:
    conn.send(command)
    return conn.recv()


def _start(target: Any, *args: Any) -> tuple[mp.process.BaseProcess, Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return process, parent


def _client_specs(scenario: Scenario, port: int) -> list[WorkerSpec]:
    specs = [WorkerSpec(f"127.0.0.1:{port}", []) for _ in range(scenario.workers)]
    for index in range(scenario.clients):
        specs[index % scenario.workers].clients.append((f"envoy-{index:05d}", scenario.api))
    return specs


def run_scenario(scenario: Scenario) -> dict[str, Any]:
    """One full run: storm, then `ticks` publishes. Returns the measured figures."""
    load_before = os.getloadavg()[0]
    server, server_conn = _start(server_main, ServerSpec(
        scenario.pools, scenario.endpoints_per_pool, scenario.fraction,
        log_level=scenario.server_log_level))
    _, port, _, initial = server_conn.recv()
    workers = [_start(worker_main, spec) for spec in _client_specs(scenario, port)]
    fleet = Fleet([conn for _, conn in workers])
    for conn in fleet.conns:
        conn.recv()  # ready
    try:
        row = _measure(scenario, server_conn, fleet, initial)
        row["loadavg_1m_before"] = load_before  # other work on the box skews every figure
        return row
    finally:
        _stop(fleet.conns, [p for p, _ in workers])  # clients first: no stream is cut
        _stop([server_conn], [server])


def _measure(scenario: Scenario, server_conn: Connection, fleet: Fleet,
             initial: dict[str, Any]) -> dict[str, Any]:
    profiles: list[str] = []
    fleet.command(("expect", 0, initial["keys"]))
    before_storm = _ask(server_conn, ("mark",))[1]
    go = time.monotonic()
    with _profiling(server_conn, scenario.profile, "reconnect storm", profiles):
        fleet.command(("go",))
        storm_ok = fleet.wait_ticks(range(1), go + 60.0)
    start = _ask(server_conn, ("mark",))[1]
    start["client_cpu_s"] = sum(reply[1] for reply in fleet.command(("mark",)))
    with _profiling(server_conn, scenario.profile, "ticks", profiles):
        published, builds = _run_ticks(scenario, server_conn, fleet)
        end = _ask(server_conn, ("mark",))[1]
        end["client_cpu_s"] = sum(reply[1] for reply in fleet.command(("mark",)))
        settled = fleet.wait_ticks(range(scenario.ticks + 1),
                                   published[-1] + scenario.interval + scenario.settle_s)
    reports = [reply[1] for reply in fleet.command(("report",))]
    return summarize(scenario, go, published, builds, reports,
                     {"before_storm": before_storm, "start": start, "end": end,
                      "storm_ok": storm_ok, "settled": settled, "profile": "".join(profiles)})


@contextlib.contextmanager
def _profiling(server_conn: Connection, enabled: bool, title: str,
               out: list[str]) -> Iterator[None]:
    """cProfile the server (its event-loop thread) while the block runs."""
    if enabled:
        _ask(server_conn, ("profile", "start"))
    try:
        yield
    finally:
        if enabled:
            out.append(f"===== server profile: {title} =====\n"
                       + _ask(server_conn, ("profile", "stop"))[1])


def _run_ticks(scenario: Scenario, server_conn: Connection, fleet: Fleet
               ) -> tuple[list[float], list[float]]:
    published, builds = [], []
    first = time.monotonic() + 0.2
    for tick in range(1, scenario.ticks + 1):
        fleet.sleep_until(first + (tick - 1) * scenario.interval)
        prepared = _ask(server_conn, ("prepare",))[1]
        fleet.command(("expect", tick, prepared["keys"]))
        published.append(_ask(server_conn, ("publish",))[1])
        builds.append(prepared["build_s"])
    fleet.sleep_until(published[-1] + scenario.interval)
    return published, builds


def _stop(conns: list[Connection], processes: list[mp.process.BaseProcess]) -> None:
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("stop",))
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; inf if any value is missing (a client never got it)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def _tick_latency(done: list[float | None], published: float) -> float:
    return math.inf if any(t is None for t in done) else max(done) - published  # type: ignore


def summarize(scenario: Scenario, go: float, published: list[float], builds: list[float],
              reports: list[dict[str, Any]], marks: dict[str, Any]) -> dict[str, Any]:
    done = [[t for report in reports for t in report["done"][tick]]
            for tick in range(scenario.ticks + 1)]
    latencies = [_tick_latency(done[tick], published[tick - 1])
                 for tick in range(1, scenario.ticks + 1)]
    start, end = marks["start"], marks["end"]
    storm = [t - go for t in done[0] if t is not None]
    storm_s = max(storm) if len(storm) == scenario.clients else math.inf
    pushed = sum(end["pushed_bytes"].values()) - sum(start["pushed_bytes"].values())
    row = {
        **asdict(scenario), "endpoints": scenario.pools * scenario.endpoints_per_pool,
        "storm_s": storm_s, "storm_p50_s": percentile(storm, 50),
        "tick_p50_s": percentile(latencies, 50), "tick_p99_s": percentile(latencies, 99),
        "tick_max_s": max(latencies), "tick_latencies_s": latencies,
        "median_client_p50_s": percentile([percentile([t - published[i - 1] for t in done[i]
                                                       if t is not None], 50)
                                           for i in range(1, scenario.ticks + 1)], 50),
        "build_p50_s": percentile(builds, 50),
        "server_cpu_cores": (end["cpu_s"] - start["cpu_s"]) / (end["wall"] - start["wall"]),
        "server_storm_cpu_s": start["cpu_s"] - marks["before_storm"]["cpu_s"],
        "server_thread_cores": {name: (cpu - start["threads"].get(name, 0.0))
                                / (end["wall"] - start["wall"])
                                for name, cpu in end["threads"].items()},
        "server_peak_rss_mb": end["peak_rss_mb"], "server_rss_mb": end["rss_mb"],
        "pushed_mb_per_tick": pushed / scenario.ticks / 2**20,
        "received_mb_total": sum(r["bytes_received"] for r in reports) / 2**20,
        "client_cpu_cores": (end["client_cpu_s"] - start["client_cpu_s"])
        / (end["wall"] - start["wall"]),
        "errors": [e for r in reports for e in r["errors"]][:5],  # still failing at the end
        "error_count": sum(len(r["errors"]) for r in reports),
        "stream_failures": sum(r["failures"] for r in reports),  # each retried, like Envoy
        "failed_clients": sum(r["failed_clients"] for r in reports),
        "streams_at_end": end["streams"], "settled": marks["settled"],
    }
    row["meets_target"] = meets_target(row)
    row["storm_within_bound"] = row["storm_s"] <= STORM_BOUND_S
    if marks["profile"]:
        row["profile"] = marks["profile"]
    return row


def meets_target(row: dict[str, Any]) -> bool:
    return (row["tick_p99_s"] <= LATENCY_BOUND_S and row["error_count"] == 0
            and row["server_cpu_cores"] <= CPU_BOUND_CORES
            and row["server_peak_rss_mb"] <= RSS_BOUND_MB)


# --- output --------------------------------------------------------------------------------------

COLUMNS = [("api", "api", "{}"), ("clients", "N", "{}"), ("endpoints", "M", "{}"),
           ("pools", "P", "{}"), ("storm_s", "storm s", "{:.2f}"),
           ("tick_p50_s", "tick p50 s", "{:.3f}"), ("tick_p99_s", "tick p99 s", "{:.3f}"),
           ("server_cpu_cores", "srv cores", "{:.2f}"), ("server_peak_rss_mb", "srv RSS MB", "{:.0f}"),
           ("pushed_mb_per_tick", "MB/tick", "{:.1f}"), ("build_p50_s", "build s", "{:.3f}"),
           ("client_cpu_cores", "cli cores", "{:.2f}"), ("stream_failures", "retries", "{}"),
           ("meets_target", "ok", "{}")]


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[title for _, title, _ in COLUMNS]]
    cells += [[fmt.format(row[key]) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def write_results(payload: dict[str, Any], path: Path = RESULTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(payload)
    path.write_text(json.dumps(existing, indent=2, default=str) + "\n")


# --- modes ---------------------------------------------------------------------------------------

def sweep(args: argparse.Namespace, api: str) -> list[dict[str, Any]]:
    """For each endpoint count, raise N until the 1 s bound (or CPU/RSS) is missed."""
    rows = []
    print(table([]), flush=True)
    for pools in args.sweep_pools:
        for clients in args.sweep_clients:
            row = run_scenario(_scenario(args, api, clients, pools, ticks=args.sweep_ticks))
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            if not row["meets_target"]:
                break
    return rows


def _scenario(args: argparse.Namespace, api: str, clients: int, pools: int,
              ticks: int | None = None) -> Scenario:
    return Scenario(api, clients, pools, args.endpoints_per_pool, args.workers,
                    ticks or args.ticks, args.interval, args.fraction, args.profile,
                    args.server_log_level)


def best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r["meets_target"]]
    return max(ok, key=lambda r: (r["clients"] * r["endpoints"], r["clients"]), default=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--api", choices=("sotw", "delta", "both"), default="both")
    parser.add_argument("--clients", type=int, default=1000, help="N streams")
    parser.add_argument("--pools", type=int, default=100, help="P pools (clusters)")
    parser.add_argument("--endpoints-per-pool", type=int, default=100, help="E")
    parser.add_argument("--workers", type=int, default=1, help="K client processes")
    parser.add_argument("--ticks", type=int, default=10)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds per tick")
    parser.add_argument("--fraction", type=float, default=0.10, help="weights changed per tick")
    parser.add_argument("--profile", action="store_true", help="cProfile the server (storm, ticks)")
    parser.add_argument("--server-log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="the server's log level (trimtab's default: info; to /dev/null)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-clients", type=int, nargs="+", default=[250, 500, 1000, 2000])
    parser.add_argument("--sweep-pools", type=int, nargs="+", default=[10, 100, 500])
    parser.add_argument("--sweep-ticks", type=int, default=5)
    parser.add_argument("--sizes-only", action="store_true", help="only the 4 MiB analysis")
    parser.add_argument("--no-sizes", action="store_true", help="skip the 4 MiB analysis")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    payload: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    if not args.no_sizes:
        payload["message_sizes"] = message_sizes()
        for row in payload["message_sizes"]:
            print(f"50k endpoints as {row['pools']} x {row['endpoints_per_pool']}: "
                  f"largest EDS response {max(row['sotw_eds'], row['delta_eds']) / 2**20:.2f} MiB "
                  f"(4 MiB reached at ~{row['endpoints_at_4mib']:,} endpoints); "
                  f"largest CLA {row['largest_cla'] / 1024:.0f} KiB; "
                  f"CDS {row['sotw_cds'] / 1024:.0f} KiB", flush=True)
    if not args.sizes_only:
        apis = ["sotw", "delta"] if args.api == "both" else [args.api]
        for api in apis:
            payload.update(_run_mode(args, api))
    write_results(payload)
    print(f"results: {RESULTS}")
    return 0


def _run_mode(args: argparse.Namespace, api: str) -> dict[str, Any]:
    if args.sweep:
        rows = sweep(args, api)
        top = best(rows)
        print(table(rows))
        print(f"{api}: largest N x M within {LATENCY_BOUND_S:.0f} s: "
              + (f"{top['clients']} x {top['endpoints']}" if top else "none"))
        return {f"sweep_{api}": rows, f"sweep_{api}_best": top}
    row = run_scenario(_scenario(args, api, args.clients, args.pools))
    print(table([row]), flush=True)
    if row.get("profile"):
        path = PROFILE_TXT.with_stem(f"{PROFILE_TXT.stem}_{api}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(row.pop("profile"))
        row["profile_file"] = str(path.relative_to(RESULTS.parent.parent.parent))
        print(f"server profile: {path}")
    return {f"{'profiled_' if args.profile else ''}run_{api}": row}  # profiling slows it


if __name__ == "__main__":
    sys.exit(main())
