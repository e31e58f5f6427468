"""Push latency with a real Envoy: how long until a weight change is live in Envoy.

Runs trimtab IN-PROCESS (``xds_server.app.Trimtab`` on a background event loop) so that the
moment a snapshot is published (``SnapshotCache.set_snapshot``) can be timestamped on the same
clock as the poller, three fake GPU backends, and Envoy (``--api sotw|delta``). For each of
``--changes`` weight changes it measures

  (a) telemetry -> Envoy: a backend's GPU memory changes -> Envoy's ``/clusters?format=json``
      shows the new weight. Dominated by where in the tick the change lands (0..interval), so
      changes are spread over the tick phase at random;
  (b) publish -> Envoy: the snapshot holding the new weight is published -> Envoy shows it
      (encode, gRPC, Envoy applying EDS, plus the poll period).

Prints p50/p99 of both and writes them (with the raw samples) to
benchmarks/results/push_latency.json, one entry per API and interval under "runs" (e.g.
"sotw-2s"). Usage::

    python benchmarks/push_latency.py [--api delta] [--interval 2] [--changes 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import logging
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trimtab_dev.demo.fake_gpu import DemoBackends
from trimtab_dev.envoy_process import EnvoyProcess, envoy_binary, free_port, render_bootstrap
from xds_server.app import Trimtab
from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.xds.snapshot import Snapshot

POOL = "bench"
MODEL = "bench/model"
POLL_PAUSE_S = 0.001  # between two /clusters polls: the resolution of both measurements
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "push_latency.json"


def expected_weight(used_mib: int, total_mib: int) -> int:
    """The documented formula: clamp(round(100 - gpu_mem_pct / 2), 1, 100)."""
    return max(1, min(100, round(100 - (100.0 * used_mib / total_mib) / 2)))


@dataclass
class InProcessTrimtab:
    """trimtab on a background event loop, with every publish timestamped (perf_counter)."""

    config: Config
    published: list[tuple[float, str]] = field(default_factory=list)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None
    _run: Any = None

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trimtab", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(15)

    async def _start(self) -> None:
        app = Trimtab(self.config)
        original = app.cache.set_snapshot

        def timed_set_snapshot(snapshot: Snapshot) -> bool:
            changed = original(snapshot)
            if changed:
                self.published.append((time.perf_counter(), snapshot.version))
            return changed

        app.cache.set_snapshot = timed_set_snapshot  # type: ignore[method-assign]
        await app.start()
        self._stop = asyncio.Event()
        self._run = asyncio.ensure_future(app.run(self._stop))

    def publish_after(self, moment: float) -> float | None:
        """When the first snapshot published after `moment` was published."""
        return next((at for at, _ in list(self.published) if at > moment), None)

    async def _shutdown(self) -> None:
        if self._stop is not None and self._run is not None:
            self._stop.set()
            await asyncio.wait_for(self._run, 10)

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(15)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()
            self._loop = self._thread = None


class EnvoyPoller:
    """Polls one host's weight in Envoy's /clusters over a kept-alive connection."""

    def __init__(self, admin_port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", admin_port, timeout=5)

    def weight(self, cluster: str, address: str) -> int | None:
        self.conn.request("GET", "/clusters?format=json")
        statuses = json.loads(self.conn.getresponse().read()).get("cluster_statuses", [])
        for status in statuses:
            if status.get("name") != cluster:
                continue
            for host in status.get("host_statuses", []):
                sock = host["address"]["socket_address"]
                if f"{sock['address']}:{sock['port_value']}" == address:
                    return int(host.get("weight", 1))
        return None

    def wait_for(self, cluster: str, address: str, weight: int, timeout: float) -> float:
        """Poll until `address` has `weight`; return when (perf_counter)."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.weight(cluster, address) == weight:
                return time.perf_counter()
            time.sleep(POLL_PAUSE_S)
        raise TimeoutError(f"Envoy did not show weight {weight} for {address} in {timeout}s")

    def close(self) -> None:
        self.conn.close()


def trimtab_config(backends: DemoBackends, interval: float, ports: dict[str, int]) -> Config:
    return parse_config({
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": interval,
                      "stale_after_seconds": max(6.0, 3 * interval)},
        "pools": [{"name": POOL, "model": MODEL, "lb_policy": "round_robin",
                   "endpoints": [{"address": a} for a in backends.addresses]}],
    })


def next_change(backends: DemoBackends, index: int, rng: random.Random) -> tuple[float, int]:
    """A memory percentage whose weight differs from the current one, and that weight."""
    server = backends.servers[index]
    current = expected_weight(server.used_mib, server.total_mib)
    while True:
        pct = rng.uniform(0.0, 100.0)
        used = round(server.total_mib * pct / 100)
        weight = expected_weight(used, server.total_mib)
        if weight != current:
            return pct, weight


@dataclass
class Samples:
    telemetry_to_envoy: list[float] = field(default_factory=list)
    publish_to_envoy: list[float] = field(default_factory=list)


def measure(backends: DemoBackends, trimtab: InProcessTrimtab, poller: EnvoyPoller,
            args: argparse.Namespace) -> Samples:
    rng = random.Random(args.seed)
    samples = Samples()
    timeout = 3 * args.interval + 5
    for change in range(args.changes):
        index = change % len(backends.servers)
        pct, weight = next_change(backends, index, rng)
        changed_at = time.perf_counter()
        backends.set_used_pct(index, pct)
        seen_at = poller.wait_for(POOL, backends.addresses[index], weight, timeout)
        published_at = trimtab.publish_after(changed_at)
        if published_at is None or published_at > seen_at:
            raise RuntimeError(f"change {change}: no publish between the change and Envoy")
        samples.telemetry_to_envoy.append(seen_at - changed_at)
        samples.publish_to_envoy.append(seen_at - published_at)
        time.sleep(rng.uniform(0.0, args.interval))  # spread changes over the tick phase
    return samples


def summary(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": round(cuts[49] * 1000, 2), "p99_ms": round(cuts[98] * 1000, 2),
            "mean_ms": round(statistics.fmean(values) * 1000, 2),
            "max_ms": round(max(values) * 1000, 2), "n": len(values)}


def envoy_version() -> str:
    result = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True,
                            timeout=30, check=False)
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "unknown"


def run(args: argparse.Namespace) -> dict[str, Any]:
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    with contextlib.ExitStack() as cleanup:
        backends = DemoBackends([0, 0, 0]).start()
        cleanup.callback(backends.stop)
        for index in range(3):
            backends.set_used_pct(index, 50.0)
        trimtab = InProcessTrimtab(trimtab_config(backends, args.interval, ports))
        cleanup.callback(trimtab.stop)
        trimtab.start()
        envoy = EnvoyProcess()
        cleanup.callback(envoy.stop)
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api=args.api))
        envoy.wait_ready(timeout=30)
        poller = EnvoyPoller(ports["envoy_admin"])
        cleanup.callback(poller.close)
        first = backends.servers[0]
        poller.wait_for(POOL, first.address, expected_weight(first.used_mib, first.total_mib), 30)
        samples = measure(backends, trimtab, poller, args)
    return report(args, samples)


def report(args: argparse.Namespace, samples: Samples) -> dict[str, Any]:
    return {
        "api": args.api,
        "interval_seconds": args.interval,
        "changes": args.changes,
        "poll_pause_ms": POLL_PAUSE_S * 1000,
        "telemetry_to_envoy": summary(samples.telemetry_to_envoy),
        "publish_to_envoy": summary(samples.publish_to_envoy),
        "envoy": envoy_version(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {platform.system()}",
        "samples_ms": {
            "telemetry_to_envoy": [round(v * 1000, 3) for v in samples.telemetry_to_envoy],
            "publish_to_envoy": [round(v * 1000, 3) for v in samples.publish_to_envoy],
        },
    }


def run_key(api: str, interval: float) -> str:
    return f"{api}-{interval:g}s"


def save(path: Path, result: dict[str, Any]) -> None:
    """Keep the latest result per API and interval: ``{"runs": {"sotw-2s": ..., ...}}``."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        document = {}
    runs = document.get("runs") if isinstance(document.get("runs"), dict) else {}
    runs[run_key(result["api"], result["interval_seconds"])] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "push_latency", "runs": runs}, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--api", choices=["sotw", "delta"], default="sotw")
    parser.add_argument("--interval", type=float, default=2.0,
                        help="telemetry.interval_seconds (2, the product default)")
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.changes < 2 or args.interval <= 0:
        parser.error("--changes must be >= 2 and --interval > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    print(f"push latency: {args.changes} weight changes, api={args.api}, "
          f"interval={args.interval:g}s (about {args.changes * args.interval:.0f}s)", flush=True)
    result = run(args)
    for key, label in (("telemetry_to_envoy", "(a) telemetry change -> Envoy"),
                       ("publish_to_envoy", "(b) publish -> Envoy applied")):
        stats = result[key]
        print(f"{label:<32} p50 {stats['p50_ms']:8.1f} ms   p99 {stats['p99_ms']:8.1f} ms   "
              f"(mean {stats['mean_ms']:.1f}, max {stats['max_ms']:.1f}, n={stats['n']})")
    save(args.output, result)
    print(f"wrote {args.output} (runs.{run_key(args.api, args.interval)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
