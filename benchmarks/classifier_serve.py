"""Benchmark: the intent-classifier hop with the classifier embedded in a ticking `trimtab serve`
(issue 16), and what an outage of that classifier costs.

Same method as ``benchmarks/request_features.py`` (whose pieces it uses): Envoy 1.40 on a static
bootstrap built by trimtab's own builders, a ``direct_response`` upstream in the same Envoy, a
2 KB text-only chat request that matches no rule, an open-loop client at ``--rate`` req/s, and
Envoy's added time per request from its access log (total minus the upstream exchange, µs).
What differs: a real ``trimtab serve`` runs next to Envoy and ticks every ``--interval`` s over
a fleet pool of ``--endpoints`` endpoints whose telemetry (source ``file``) the benchmark
rewrites every tick with new values, so each tick parses, weighs, builds and publishes.

* ``serve-baseline``: the pool without tiers; trimtab serve ticks beside it (the control);
* ``serve-classifier``: the pool with ``intent_tiers``: every request takes the ext_proc hop
  to the classifier *inside that trimtab serve* (``classifier.embedded``, rules only);
* ``serve-outage``: as ``serve-classifier``, and trimtab serve is SIGKILLed halfway through
  the measured time: the classifier dies with its streams; the figure is failed requests.

"added" is ``serve-classifier`` minus ``serve-baseline`` of the same round; rounds rotate the
order; the summary is the median and [min..max] over rounds. Writes
``benchmarks/results/classifier_serve.json``.

    .venv/bin/python benchmarks/classifier_serve.py [--seconds 10] [--rounds 3] [--rate 200]

``--alt-pythonpath DIR`` adds ``serve-classifier-alt``: ``serve-classifier`` with trimtab serve
run from another checkout's ``xds_server`` (``PYTHONPATH=DIR``), in the same rounds: e.g. the
thread-based embedded classifier of commit 9ea632c, for the comparison in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.request_features import (  # noqa: E402
    WARMUP_S,
    _envoy_stats,
    _stop,
    _wait_ready,
    added_time,
    bootstrap,
    drive,
    variant_config,
)
from benchmarks.request_features import summarise as summarise_rounds  # noqa: E402
from trimtab_dev.envoy_process import envoy_binary, free_port  # noqa: E402
from xds_server.config.load import parse_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "classifier_serve.json"
VARIANTS = ["serve-baseline", "serve-classifier", "serve-outage", "serve-classifier-alt"]
FLEET_MODEL = "m-fleet"


def fleet_addresses(count: int) -> list[str]:
    return [f"10.{i // 250}.{i % 250}.1:8000" for i in range(count)]


def write_telemetry(path: Path, addresses: list[str], rng: random.Random) -> None:
    """New values for every endpoint (the bench pools' too), written whole then renamed."""
    data = {a: {"kv_usage": round(rng.uniform(0.1, 0.9), 3), "queue": rng.randint(0, 20),
                "running": rng.randint(1, 48), "itl_ms": round(rng.uniform(8, 60), 2),
                "gpu_mem_pct": round(rng.uniform(50, 95), 1)} for a in addresses}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def serve_document(variant: str, ports: dict[str, int], telemetry: Path, endpoints: int,
                   interval: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trimtab serve's config, the same without the fleet pool for Envoy's bootstrap)."""
    kind = "baseline" if variant == "serve-baseline" else "classifier"  # -alt, -outage too
    envoy_config = variant_config(kind, f"127.0.0.1:{ports['upstream']}", ports["classifier"])
    envoy_doc = envoy_config.model_dump(mode="json", exclude_none=True)
    serve = json.loads(json.dumps(envoy_doc))
    serve["xds"]["address"] = f"127.0.0.1:{ports['xds']}"
    serve["admin"]["address"] = f"127.0.0.1:{ports['admin']}"
    serve["listener"]["address"] = f"127.0.0.1:{free_port()}"
    serve["telemetry"].update({"source": "file", "file": str(telemetry),
                               "interval_seconds": interval, "stale_after_seconds": interval * 6})
    serve["pools"].append({"name": "fleet", "model": FLEET_MODEL, "endpoints": [
        {"address": a} for a in fleet_addresses(endpoints)]})
    return serve, envoy_doc


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.read().decode()


def _metric(page: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", page, re.M)
    return sum(float(v) for v in found)


def _wait_serve(admin: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trimtab serve exited: {log.read_text()[-2000:]}")
        try:
            _get(f"http://127.0.0.1:{admin}/readyz")  # 200 once the first snapshot is out
            return
        except OSError:  # not listening yet, or 503 (HTTPError)
            time.sleep(0.1)
    raise RuntimeError("trimtab serve not ready")


def run_variant(variant: str, rate: float, seconds: float, endpoints: int, interval: float,
                workdir: Path, seed: int, pythonpath: str | None = None) -> dict[str, Any]:
    ports = {n: free_port() for n in ("envoy_admin", "listen", "upstream", "classifier", "xds",
                                      "admin")}
    telemetry = workdir / f"{variant}-telemetry.json"
    serve_doc, envoy_doc = serve_document(variant, ports, telemetry, endpoints, interval)
    addresses = [e["address"] for p in serve_doc["pools"] for e in p["endpoints"]]
    rng = random.Random(seed)
    write_telemetry(telemetry, addresses, rng)
    config_path = workdir / f"{variant}-trimtab.json"
    config_path.write_text(json.dumps(serve_doc))
    access_log = workdir / f"{variant}-access.log"
    access_log.unlink(missing_ok=True)
    envoy_path = workdir / f"{variant}-envoy.json"
    envoy_path.write_text(json.dumps(bootstrap(parse_config(envoy_doc), ports["envoy_admin"],
                                               ports["listen"], ports["upstream"], access_log)))
    serve_log = workdir / f"{variant}-trimtab.log"
    stop_writer = threading.Event()

    def writer() -> None:
        while not stop_writer.wait(interval):
            write_telemetry(telemetry, addresses, rng)

    with serve_log.open("ab") as log:
        serve = subprocess.Popen([sys.executable, "-m", "xds_server.cli", "--log-level",
                                  "warning", "serve", "--config", str(config_path)],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": pythonpath}
                                 if pythonpath else None)
    envoy_log = workdir / f"{variant}-envoy.log"
    envoy = subprocess.Popen([envoy_binary(), "-c", str(envoy_path), "--disable-hot-restart",
                              "--concurrency", "1", "-l", "warning", "--log-path", str(envoy_log),
                              "--base-id", str(ports["envoy_admin"])],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    thread = threading.Thread(target=writer, daemon=True)
    killer: threading.Timer | None = None
    serve_stats: dict[str, float] = {}
    try:
        _wait_serve(ports["admin"], serve, serve_log)
        _wait_ready(ports["envoy_admin"], envoy, envoy_log)
        time.sleep(2 * interval)  # a couple of ticks before the load
        thread.start()
        before = _get(f"http://127.0.0.1:{ports['admin']}/metrics")
        if variant == "serve-outage":
            killer = threading.Timer(WARMUP_S + seconds / 2, os.kill,
                                     (serve.pid, signal.SIGKILL))
            killer.start()
        result = asyncio.run(drive(ports["listen"], rate, seconds))
        result["envoy_stats"] = _envoy_stats(ports["envoy_admin"])
        if serve.poll() is None:
            after = _get(f"http://127.0.0.1:{ports['admin']}/metrics")
            for name in ("trimtab_tick_duration_seconds_count",
                         "trimtab_tick_duration_seconds_sum",
                         "trimtab_classifier_decision_seconds_count",
                         "trimtab_snapshots_published_total"):
                serve_stats[name] = _metric(after, name) - _metric(before, name)
        result["serve_killed"] = serve.poll() is not None
    finally:
        if killer is not None:
            killer.cancel()
        stop_writer.set()
        _stop(envoy)
        _stop(serve)
    result["serve"] = serve_stats
    result.update(added_time(access_log, int(rate * WARMUP_S)))
    return result


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """request_features' summary against ``serve-baseline``, plus requests and ticks."""
    summary = summarise_rounds(rounds, VARIANTS, baseline="serve-baseline")
    for variant, entry in summary.items():
        entry["requests"] = sum(r[variant]["requests"] for r in rounds)
        ticks = [r[variant]["serve"].get("trimtab_tick_duration_seconds_count", 0)
                 for r in rounds]
        sums = [r[variant]["serve"].get("trimtab_tick_duration_seconds_sum", 0) for r in rounds]
        entry["ticks"] = sum(ticks)
        entry["mean_tick_ms"] = 1000 * sum(sums) / sum(ticks) if sum(ticks) else None
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--endpoints", type=int, default=200,
                        help="endpoints of the fleet pool trimtab serve ticks over")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="trimtab serve's telemetry interval (s)")
    parser.add_argument("--variant", action="append", choices=VARIANTS[1:3],
                        help="run only these (serve-baseline is always added)")
    parser.add_argument("--alt-pythonpath", metavar="DIR",
                        help="also run serve-classifier-alt: trimtab serve with PYTHONPATH=DIR")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chosen = ["serve-baseline", *[v for v in VARIANTS[1:3]
                                  if not args.variant or v in args.variant]]
    if args.alt_pythonpath:
        chosen.append("serve-classifier-alt")
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="trimtab-classifier-serve-") as tmp:
        for index in range(args.rounds):
            order = chosen[index % len(chosen):] + chosen[:index % len(chosen)]
            results = {}
            for variant in order:
                r = run_variant(variant, args.rate, args.seconds, args.endpoints, args.interval,
                                Path(tmp), seed=index, pythonpath=args.alt_pythonpath
                                if variant.endswith("-alt") else None)
                results[variant] = r
                ticks = r["serve"].get("trimtab_tick_duration_seconds_count", 0)
                print(f"round {index + 1} {variant:16s} Envoy added p50 "
                      f"{r['envoy_added_p50_ms']:6.3f} p99 {r['envoy_added_p99_ms']:6.3f} ms | "
                      f"client p50 {r['p50_ms']:6.3f} p99 {r['p99_ms']:6.3f} ms  "
                      f"n={r['requests']} failed={r['failed']} ticks={ticks:.0f}"
                      f"{' (serve killed mid-run)' if r['serve_killed'] else ''}", flush=True)
            rounds.append(results)
    summary = summarise(rounds)
    print(f"\nEnvoy's added time at {args.rate:.0f} req/s beside a ticking trimtab serve "
          f"({args.endpoints} endpoints every {args.interval:g} s), median over {args.rounds} "
          f"rounds [min..max]:")
    for variant, entry in summary.items():
        line = (f"  {variant:16s} p50 {entry['envoy_added_p50_ms']:.3f} ms  "
                f"p99 {entry['envoy_added_p99_ms']:.3f} ms")
        if variant != "serve-baseline":
            for stat in ("p50", "p99"):
                delta = entry[f"added_envoy_added_{stat}_ms"]
                low, high = entry[f"added_envoy_added_{stat}_ms_spread"]
                line += f" | +{stat} {delta:+.3f} [{low:+.3f}..{high:+.3f}]"
        tick = entry["mean_tick_ms"]
        line += (f" | failed {entry['failed']} of {entry['requests']}"
                 f" | ticks {entry['ticks']:.0f}"
                 + (f", mean {tick:.1f} ms" if tick is not None else ""))
        print(line)
    document = {"benchmark": "classifier_serve", "rate": args.rate, "seconds": args.seconds,
                "rounds_count": args.rounds, "endpoints": args.endpoints,
                "interval_s": args.interval, "alt_pythonpath": args.alt_pythonpath,
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                            "loadavg": list(os.getloadavg())},
                "summary": summary, "rounds": rounds}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
