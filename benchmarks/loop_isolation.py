"""Benchmark: does serving wait for telemetry work? (issue 13 §1)

Runs trimtab in this process (``xds_server.app.Trimtab``: xDS gRPC, admin API, controller)
and, in separate processes so that they do not share its GIL, the telemetry peers and a probe:

* ``big-page``: three ordinary vLLM endpoints and one whose page is a valid 15 MiB page of
  about 288k series, scraped every tick. With the default ``telemetry.max_series_per_page``
  the page is refused after counting; ``big-page-parsed`` (no target: the worst case the cap
  exists for) raises the cap above the page so that the whole page is parsed every tick (on
  the telemetry worker thread);
* ``promql-10k``: 10,000 endpoints read through a fake Prometheus (five default-signal
  queries of 10,000 series each), composite policy;
* ``idle``: the control, three static endpoints: what this machine gives with no telemetry
  work at all (on a shared machine its max is the floor under every other max).

The probe sends ``GET /healthz`` every 20 ms (one keep-alive connection) and, every 100 ms,
a fresh ADS CDS fetch (new channel, stream, first CDS response), for ``--seconds`` per
scenario, and reports p50 / p99 / max per scenario and run (``--runs``, for the spread; each
target is judged on the worst run), and per scenario and run the cyclic-GC collections in
trimtab's process (``gc.callbacks``: full ones per tick, the worst pauses, the tracked and
frozen objects after the probe; a collection holds the GIL on whichever thread runs it, so
its pause is the loop's). The targets (issue 13): with the big page,
``/healthz`` p99 and CDS fetch p99 <= 100 ms; with 10,000 endpoints, ``/healthz`` max <= 100 ms.
Writes ``benchmarks/results/loop_isolation.json``.

    .venv/bin/python benchmarks/loop_isolation.py [--seconds 12] [--runs 3] [--scenario idle ...]

To measure another checkout (e.g. the code before the fix), put it first on the path:
``PYTHONPATH=/tmp/old .venv/bin/python benchmarks/loop_isolation.py --output /tmp/old.json``
(scenarios needing ``max_series_per_page`` are skipped where the config lacks it).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import multiprocessing as mp
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "loop_isolation.json"
TARGET_MS = 100.0
HEALTHZ_EVERY_S = 0.02
CDS_EVERY_S = 0.1
BIG_PAGE_SERIES = 288_000
PROMQL_ENDPOINTS = 10_000
PROMQL_SIGNALS = {"kv_usage": (0.0, 1.0), "queue": (0.0, 40.0), "running": (0.0, 64.0),
                  "itl_ms": (5.0, 120.0), "gpu_mem_pct": (80.0, 95.0)}
SCENARIOS = ["idle", "big-page", "big-page-parsed", "promql-10k"]
CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


# --- telemetry peers (their own process) ------------------------------------------------------

def small_page(i: int) -> str:
    return ("# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {i}\n'
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="m"} 3\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.{i + 2}\n')


def big_page(series: int) -> str:
    """A valid vLLM page: one gauge family with ``series`` series (55 bytes each; 288k of
    them make 15.1 MiB, under the 16 MiB body limit)."""
    head = "# HELP vllm:num_requests_waiting waiting\n# TYPE vllm:num_requests_waiting gauge\n"
    lines = [f'vllm:num_requests_waiting{{model_name="m",i="{i:06d}"}} 0\n'
             for i in range(series)]
    return head + "".join(lines)


def promql_answer(signal: str, rng: random.Random) -> str:
    lo, hi = PROMQL_SIGNALS[signal]
    result = [{"metric": {"instance": address(i)}, "value": [1e9, repr(rng.uniform(lo, hi))]}
              for i in range(PROMQL_ENDPOINTS)]
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def address(i: int) -> str:
    return f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:8000"


def serve_peers(port: int, ready: Any) -> None:
    from aiohttp import web

    big = big_page(BIG_PAGE_SERIES).encode()
    rng = random.Random(13)
    answers = {signal: [promql_answer(signal, rng).encode() for _ in range(3)]
               for signal in PROMQL_SIGNALS}  # made in advance: a fake Prometheus answers fast
    served = dict.fromkeys(PROMQL_SIGNALS, 0)

    async def page(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = big if name == "big" else small_page(int(name)).encode()
        return web.Response(body=body, content_type="text/plain")

    async def query(request: web.Request) -> web.Response:
        signal = request.query["query"]
        served[signal] += 1
        body = answers[signal][served[signal] % len(answers[signal])]
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics/{name}", page)
    app.router.add_get("/api/v1/query", query)
    ready.set()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# --- the probe (its own process) --------------------------------------------------------------

def probe(admin_port: int, xds_port: int, seconds: float, out: Any) -> None:
    out.put(asyncio.run(_probe(admin_port, xds_port, seconds)))


async def _probe(admin_port: int, xds_port: int, seconds: float) -> dict[str, list[float]]:
    import aiohttp

    healthz: list[float] = []
    cds: list[float] = []
    deadline = time.perf_counter() + seconds

    async def poll_healthz() -> None:
        async with aiohttp.ClientSession() as session:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{admin_port}/healthz") as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                healthz.append(time.perf_counter() - t0)
                await asyncio.sleep(HEALTHZ_EVERY_S)

    async def fetch_cds() -> None:
        while time.perf_counter() < deadline:
            cds.append(await _one_cds_fetch(xds_port))
            await asyncio.sleep(CDS_EVERY_S)

    await asyncio.gather(poll_healthz(), fetch_cds())
    return {"healthz_s": healthz, "cds_s": cds}


async def _one_cds_fetch(xds_port: int) -> float:
    import grpc
    from envoy.service.discovery.v3 import discovery_pb2

    request = discovery_pb2.DiscoveryRequest(type_url=CDS)
    request.node.id = f"probe-{random.randrange(1 << 30)}"
    request.node.cluster = "probe"
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{xds_port}") as channel:
        call = channel.stream_stream(
            ADS, request_serializer=discovery_pb2.DiscoveryRequest.SerializeToString,
            response_deserializer=discovery_pb2.DiscoveryResponse.FromString)()
        await call.write(request)
        response = await call.read()
        elapsed = time.perf_counter() - t0
        call.cancel()
    assert response.type_url == CDS and response.resources, "no CDS answer"
    return elapsed


# --- trimtab (this process) -------------------------------------------------------------------

class GcWatch:
    """Every cyclic-GC collection in this process while installed (``gc.callbacks``): its
    generation, pause and thread. A collection holds the GIL whichever thread runs it, so
    each full one stalls the serving loop for its whole pause."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, str]] = []  # (generation, seconds, thread name)
        self._started = 0.0
        self.tracked = self.frozen = 0

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._started,
                                threading.current_thread().name))

    def heap(self) -> None:
        """Note the tracked and frozen object counts now (call while trimtab runs)."""
        self.tracked, self.frozen = len(gc.get_objects()), gc.get_freeze_count()

    def summary(self, ticks: int) -> dict[str, Any]:
        full = [(s, thread) for generation, s, thread in self.pauses if generation == 2]
        on_loop = [s for s, thread in full if thread == threading.main_thread().name]
        return {"collections": len(self.pauses), "gen2": len(full),
                "gen2_per_tick": round(len(full) / max(1, ticks), 2),
                "gen2_on_loop": len(on_loop),
                "gen2_max_ms": round(1000.0 * max((s for s, _ in full), default=0.0), 1),
                "max_ms": round(1000.0 * max((s for _, s, _ in self.pauses), default=0.0), 1),
                "tracked": self.tracked, "frozen": self.frozen}


def scenario_config(name: str, peers: int, xds: int, admin: int, listener: int
                    ) -> dict[str, Any]:
    base: dict[str, Any] = {"xds": {"address": f"127.0.0.1:{xds}"},
                            "admin": {"address": f"127.0.0.1:{admin}"},
                            "listener": {"address": f"127.0.0.1:{listener}"}}
    if name == "idle":  # the control: what this machine gives with no telemetry work
        endpoints = [{"address": f"10.1.0.{i + 1}:8000", "signals": {"gpu_mem_pct": 50.0}}
                     for i in range(3)]
        return {**base, "telemetry": {"interval_seconds": 2, "source": "static"},
                "pools": [{"name": "idle", "model": "m", "endpoints": endpoints}]}
    if name.startswith("big-page"):
        endpoints = [{"address": f"10.1.0.{i + 1}:8000",
                      "metrics_url": f"http://127.0.0.1:{peers}/metrics/{i}"} for i in range(3)]
        endpoints.append({"address": "10.1.0.9:8000",
                          "metrics_url": f"http://127.0.0.1:{peers}/metrics/big"})
        telemetry: dict[str, Any] = {"interval_seconds": 2}
        if name == "big-page-parsed":
            telemetry["max_series_per_page"] = BIG_PAGE_SERIES + 1000
        return {**base, "telemetry": telemetry, "weights": {"policy": "composite"},
                "pools": [{"name": "big", "model": "m", "endpoints": endpoints}]}
    endpoints = [{"address": address(i)} for i in range(PROMQL_ENDPOINTS)]
    queries = {signal: signal for signal in PROMQL_SIGNALS}
    return {**base, "weights": {"policy": "composite"},
            "telemetry": {"interval_seconds": 2, "source": "prometheus",
                          "prometheus": {"url": f"http://127.0.0.1:{peers}", "queries": queries}},
            "pools": [{"name": "fleet", "model": "m", "endpoints": endpoints}]}


async def run_scenario(name: str, peers: int, seconds: float) -> dict[str, Any]:
    from trimtab_dev.envoy_process import free_port
    from xds_server.app import Trimtab
    from xds_server.config.load import ConfigError, parse_config

    xds, admin = free_port(), free_port()
    try:
        config = parse_config(scenario_config(name, peers, xds, admin, free_port()))
    except ConfigError as exc:
        if "max_series_per_page" not in str(exc):
            raise
        return {"skipped": "this code has no telemetry.max_series_per_page"}
    app = Trimtab(config)
    ticks: list[float] = []
    app.controller.on_tick.append(lambda: ticks.append(time.perf_counter()))
    await app.start()
    stop = asyncio.Event()
    running = asyncio.create_task(app.run(stop))
    while not app.ready():  # the first tick, so that CDS has an answer
        await asyncio.sleep(0.05)
    out: Any = mp.get_context("spawn").Queue()
    prober = mp.get_context("spawn").Process(target=probe, args=(admin, xds, seconds, out))
    started = time.perf_counter()
    prober.start()
    with GcWatch() as watch:
        samples = await asyncio.get_running_loop().run_in_executor(None, out.get)
        await heap_after_next_tick(app.controller, watch)
    prober.join()
    stop.set()
    await running
    during = [t for t in ticks if t >= started]
    result: dict[str, Any] = {"ticks": len(during), "gc": watch.summary(len(during))}
    for key, values in samples.items():
        result[key.removesuffix("_s")] = summarise([1000.0 * v for v in values])
    return result


async def heap_after_next_tick(controller: Any, watch: GcWatch) -> None:
    """Count the heap at the end of the next tick (after the probe: the count walks every
    object). ``gc.get_objects`` must not run while another thread builds a tuple (it would
    see it half-made), so it runs in an ``on_tick`` hook: on the loop, the worker idle."""
    counted = asyncio.Event()

    def count() -> None:
        if not counted.is_set():
            watch.heap()
            counted.set()

    controller.on_tick.append(count)
    await asyncio.wait_for(counted.wait(), 30)
    controller.on_tick.remove(count)


def summarise(values_ms: list[float]) -> dict[str, float]:
    ordered = sorted(values_ms)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50_ms": statistics.median(ordered), "p99_ms": p99,
            "max_ms": ordered[-1]}


def verdicts(results: dict[str, list[dict[str, Any]]]) -> dict[str, bool]:
    """Each target, judged on the worst of the runs."""
    out = {}
    for name, runs in results.items():
        if name in ("idle", "big-page-parsed") or any("skipped" in r for r in runs):
            continue
        if name.startswith("big-page"):
            out[f"{name}: /healthz p99 <= {TARGET_MS:g} ms"] = _worst(runs, "healthz", "p99_ms")
            out[f"{name}: CDS fetch p99 <= {TARGET_MS:g} ms"] = _worst(runs, "cds", "p99_ms")
        else:
            out[f"{name}: /healthz max <= {TARGET_MS:g} ms"] = _worst(runs, "healthz", "max_ms")
    return out


def _worst(runs: list[dict[str, Any]], kind: str, stat: str) -> bool:
    return max(r[kind][stat] for r in runs) <= TARGET_MS


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = [f"{'scenario':<16} {'probe':<8} {'p50 ms':>16} {'p99 ms':>22} {'max ms':>22}"]
    for name, runs in results.items():
        if any("skipped" in r for r in runs):
            lines.append(f"{name:<16} skipped: {runs[0]['skipped']}")
            continue
        for kind in ("healthz", "cds"):
            cells = ["/".join(f"{r[kind][stat]:.0f}" for r in runs)
                     for stat in ("p50_ms", "p99_ms", "max_ms")]
            lines.append(f"{name:<16} {kind:<8} {cells[0]:>16} {cells[1]:>22} {cells[2]:>22}")
        if all("gc" in r for r in runs):
            lines.append(f"{name:<16} gc       " + gc_cells([r["gc"] for r in runs]))
    return lines


def gc_cells(gcs: list[dict[str, Any]]) -> str:
    def cells(key: str) -> str:
        return "/".join(f"{g[key]:g}" for g in gcs)

    return (f"full per tick {cells('gen2_per_tick')}, worst full ms {cells('gen2_max_ms')}, "
            f"worst any ms {cells('max_ms')}, tracked {cells('tracked')}, "
            f"frozen {cells('frozen')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="probe time per scenario")
    parser.add_argument("--scenario", action="append",
                        choices=SCENARIOS)
    parser.add_argument("--runs", type=int, default=3, help="repeat every scenario (spread)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    import xds_server

    peers_port = _free()
    ready = mp.get_context("spawn").Event()
    peers = mp.get_context("spawn").Process(target=serve_peers, args=(peers_port, ready),
                                            daemon=True)
    peers.start()
    ready.wait(60)
    time.sleep(0.5)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for run in range(args.runs):
            for name in args.scenario or SCENARIOS:
                result = asyncio.run(run_scenario(name, peers_port, args.seconds))
                results.setdefault(name, []).append(result)
                print(f"run {run + 1} {name}", json.dumps(result), flush=True)
    finally:
        peers.terminate()
        peers.join()
    print("per run (run1/run2/...):")
    print("\n".join(table(results)))
    checks = verdicts(results)
    for check, ok in checks.items():
        print(f"  {check}: {'met' if ok else 'NOT met'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "code": str(Path(xds_server.__file__).resolve().parent),
        "python": sys.version.split()[0], "machine": platform.machine(),
        "seconds_per_scenario": args.seconds, "runs": args.runs, "results": results, "targets": checks,
        "big_page_bytes": len(big_page(BIG_PAGE_SERIES).encode()),
    }, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0 if all(checks.values()) else 1


def _free() -> int:
    from trimtab_dev.envoy_process import free_port
    return free_port()


if __name__ == "__main__":
    sys.exit(main())
