"""Benchmark: what each request feature adds to a request through a real Envoy (issue 16).

Every variant is one trimtab config; the benchmark builds the listener, routes and clusters
with trimtab's own code (``build_listener``, ``build_route_config``, ``build_clusters``; EDS
clusters are given their endpoints inline) and starts Envoy 1.40 on that static bootstrap.
The upstream is a second listener of the same Envoy answering a fixed JSON body
(``direct_response``), so upstream time is as small and steady as it gets and what differs
between variants is the feature's filter work and route matching:

* ``baseline``: one pool, no feature (the JSON local replies are always on; they act only on
  Envoy's own error answers, so they cost a successful request nothing);
* ``generation``: request classes on ``max_tokens`` and ``stream`` (json_to_metadata rules and
  dynamic-metadata route matchers);
* ``modality``: an image class (the Lua filter scanning the buffered body);
* ``versions``: model versions (header and body-field routes, one more json_to_metadata rule);
* ``classifier``: intent tiers: the ext_proc hop to ``trimtab classify`` (rules only);
* ``classifier-down``: the same config with the classifier not running (fail-open).

The request is a 2 KB text-only chat request that matches no class, so every variant ends on
the same route: the figure is the price the common path pays. An open-loop client sends
``--rate`` requests/s (default 200) for ``--seconds`` per variant on keep-alive connections;
latency is from send to the last byte. Rounds (``--rounds``) run the variants in a rotated
order; "added" is the variant minus ``baseline`` of the same round, and the summary gives the
median and the spread (min..max) over rounds. Writes ``benchmarks/results/request_features.json``.

    .venv/bin/python benchmarks/request_features.py [--seconds 10] [--rounds 2] [--rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trimtab_dev.envoy_process import envoy_binary, free_port  # noqa: E402
from xds_server.config.load import parse_config  # noqa: E402
from xds_server.config.schema import Config  # noqa: E402
from xds_server.envoy.clusters import build_clusters, build_load_assignment  # noqa: E402
from xds_server.envoy.request_features import extra_clusters  # noqa: E402
from xds_server.envoy.routes import build_listener, build_route_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "request_features.json"
VARIANTS = ["baseline", "generation", "modality", "versions", "classifier", "classifier-down"]
CONNECTIONS = 16
WARMUP_S = 1.0
# Envoy's own timestamps (µs): its added time is the whole stay minus the upstream exchange.
DURATIONS = {"total": ("DS_RX_BEG", "DS_TX_END"), "upstream": ("US_TX_BEG", "US_RX_END"),
             "to_upstream": ("DS_RX_BEG", "US_TX_BEG")}
ANSWER = json.dumps({"id": "bench", "choices": [{"message": {"role": "assistant",
                                                             "content": "ok"}}]})


def _pool(name: str, model: str, address: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": model, "endpoints": [{"address": address}],
            "outlier_detection": {"enabled": False}, **extra}


def variant_config(variant: str, upstream: str, classifier_port: int) -> Config:
    extra: dict[str, Any] = {}
    document: dict[str, Any] = {}
    if variant == "generation":
        extra["request_classes"] = [{"pool": "alt", "max_tokens": {"min": 4097}},
                                    {"pool": "alt", "stream": True}]
    elif variant == "modality":
        extra["request_classes"] = [{"pool": "alt", "modality": "image"}]
    elif variant == "versions":
        extra["model_versions"] = {"pools": {"2": "alt"}}
    elif variant.startswith("classifier"):
        extra["intent_tiers"] = {"code": "alt"}
        document["classifier"] = {"address": f"127.0.0.1:{classifier_port}",
                                  "message_timeout_ms": 50,
                                  "rules": [{"tier": "code", "keywords": ["python", "rust"],
                                             "patterns": [r"\bdef \w+\(", r"```"]},
                                            {"tier": "code", "min_chars": 100_000}]}
    alt_model = "m-bench" if extra else "m-alt"  # a target of a class shares the model
    pools = [_pool("bench", "m-bench", upstream, **extra), _pool("alt", alt_model, upstream)]
    return parse_config({**document, "pools": pools})


def _dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def bootstrap(config: Config, admin_port: int, listen_port: int, upstream_port: int,
              access_log: Path) -> dict[str, Any]:
    """trimtab's LDS/RDS/CDS/EDS as one static Envoy config, plus the upstream listener."""
    listener = _dict(build_listener(config))
    listener["address"]["socket_address"]["port_value"] = listen_port
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    del hcm["rds"]
    hcm["route_config"] = _dict(build_route_config(config))
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(access_log),
        "log_format": {"json_format": {key: f"%COMMON_DURATION({a}:{b}:us)%"
                                       for key, (a, b) in DURATIONS.items()}}}}]
    clusters = []
    for pool in config.pools:
        for cluster in build_clusters(pool):
            document = _dict(cluster)
            if "eds_cluster_config" in document:
                del document["eds_cluster_config"]
                document["type"] = "STATIC"
                endpoints = dict((n, e) for n, _, e in pool.clusters())[cluster.name]
                document["load_assignment"] = _dict(
                    build_load_assignment(cluster.name, endpoints, {}))
            clusters.append(document)
    clusters += [_dict(cluster) for cluster in extra_clusters(config)]
    answer = {"status": 200, "body": {"inline_string": ANSWER}}
    upstream_hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager."
                 "v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "route_config": {"virtual_hosts": [{"name": "up", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": answer}]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    upstream = {"name": "upstream", "address": {"socket_address": {
        "address": "127.0.0.1", "port_value": upstream_port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": upstream_hcm}]}]}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                     "port_value": admin_port}}},
            "static_resources": {"listeners": [listener, upstream], "clusters": clusters}}


def request_bytes() -> bytes:
    text = ("Summarise the following notes for a weekly status e-mail. " * 34)[:2000]
    body = json.dumps({"model": "m-bench", "max_tokens": 256, "temperature": 0.7,
                       "messages": [{"role": "system", "content": "You are concise."},
                                    {"role": "user", "content": text}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    return head + body


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def exchange(self, raw: bytes) -> int:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        await self.reader.readexactly(length)
        return status


async def drive(port: int, rate: float, seconds: float) -> dict[str, Any]:
    """Open loop: request i starts at t0 + i / rate (on an idle connection; a new one when
    none is idle). Latency from that send to the last byte of the answer."""
    raw = request_bytes()
    idle: list[Connection] = []
    latencies: list[float] = []
    failures: dict[str, int] = {}

    async def connect() -> Connection:
        return Connection(*await asyncio.open_connection("127.0.0.1", port))

    for _ in range(CONNECTIONS):
        idle.append(await connect())

    async def one(record: bool) -> None:
        conn = idle.pop() if idle else await connect()
        started = time.perf_counter()
        try:
            status = await conn.exchange(raw)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            conn.writer.close()
            return
        elapsed = time.perf_counter() - started
        idle.append(conn)
        if status != 200:
            failures[str(status)] = failures.get(str(status), 0) + 1
        elif record:
            latencies.append(elapsed)

    tasks = []
    t0 = time.perf_counter()
    total = int(rate * (seconds + WARMUP_S))
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(record=i >= rate * WARMUP_S)))
    await asyncio.gather(*tasks)
    for conn in idle:
        conn.writer.close()
    ordered = sorted(latencies)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else 0.0

    return {"requests": len(ordered), "failed": sum(failures.values()), "failures": failures,
            "p50_ms": q(0.50), "p99_ms": q(0.99), "mean_ms":
            statistics.fmean(ordered) * 1000 if ordered else 0.0}


def _wait_ready(admin_port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Envoy exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("Envoy not ready")


def _envoy_stats(admin_port: int) -> dict[str, int]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?filter=ext_proc|lua|"
                                f"json_to_metadata", timeout=2) as resp:
        text = resp.read().decode()
    stats = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.isdigit() and int(value):
            stats[name] = int(value)
    return stats


def _classifier(config_path: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "xds_server.classify", "--config",
                             str(config_path), "--log-level", "warning"],
                            stdin=subprocess.DEVNULL)
    import socket

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("classifier did not start")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def run_variant(variant: str, rate: float, seconds: float, workdir: Path) -> dict[str, Any]:
    ports = {name: free_port() for name in ("admin", "listen", "upstream", "classifier")}
    config = variant_config(variant, f"127.0.0.1:{ports['upstream']}", ports["classifier"])
    config_path = workdir / f"{variant}.yaml"
    config_path.write_text(json.dumps(config.model_dump(mode="json", exclude_none=True)))
    envoy_config = workdir / f"{variant}-envoy.json"
    access_log = workdir / f"{variant}-access.log"
    access_log.unlink(missing_ok=True)
    envoy_config.write_text(json.dumps(bootstrap(config, ports["admin"], ports["listen"],
                                                 ports["upstream"], access_log)))
    log = workdir / f"{variant}-envoy.log"
    classifier = None
    envoy = subprocess.Popen([envoy_binary(), "-c", str(envoy_config), "--disable-hot-restart",
                              "--concurrency", "1", "-l", "warning", "--log-path", str(log),
                              "--base-id", str(ports["admin"])],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        if variant == "classifier":
            classifier = _classifier(config_path, ports["classifier"])
        _wait_ready(ports["admin"], envoy, log)
        result = asyncio.run(drive(ports["listen"], rate, seconds))
        result["envoy_stats"] = _envoy_stats(ports["admin"])
    finally:
        _stop(classifier)
        _stop(envoy)
    result.update(added_time(access_log, int(rate * WARMUP_S)))
    return result


def added_time(access_log: Path, skip: int) -> dict[str, Any]:
    """Envoy's added time per request (µs) from its access log, warm-up lines skipped."""
    added = []
    for line in access_log.read_text().splitlines()[skip:]:
        entry = json.loads(line)
        try:
            added.append(int(entry["total"]) - int(entry["upstream"]))
        except (TypeError, ValueError, KeyError):
            continue  # no upstream exchange (an error answer)
    added.sort()

    def q(p: float) -> float:
        return added[min(len(added) - 1, int(p * len(added)))] / 1000 if added else 0.0

    return {"envoy_added_p50_ms": q(0.50), "envoy_added_p99_ms": q(0.99),
            "envoy_added_count": len(added)}


def summarise(rounds: list[dict[str, dict[str, Any]]], variants: Sequence[str] = VARIANTS,
              baseline: str = "baseline") -> dict[str, Any]:
    """Per variant present in every round: failed requests, the median of each latency over
    the rounds, and (against ``baseline`` of the same round) the added median and spread."""
    summary: dict[str, Any] = {}
    for variant in variants:
        if any(variant not in r for r in rounds):
            continue
        entry: dict[str, Any] = {"failed": sum(r[variant]["failed"] for r in rounds)}
        for stat in ("envoy_added_p50_ms", "envoy_added_p99_ms", "p50_ms", "p99_ms"):
            values = [r[variant][stat] for r in rounds]
            entry[stat] = statistics.median(values)
            if variant != baseline and all(baseline in r for r in rounds):
                added = [r[variant][stat] - r[baseline][stat] for r in rounds]
                entry[f"added_{stat}"] = statistics.median(added)
                entry[f"added_{stat}_spread"] = [min(added), max(added)]
        summary[variant] = entry
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="run only these (baseline is always added)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    chosen = ["baseline", *[v for v in VARIANTS[1:] if not args.variant or v in args.variant]]
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="trimtab-features-") as tmp:
        for index in range(args.rounds):
            order = chosen[index % len(chosen):] + chosen[:index % len(chosen)]
            results = {}
            for variant in order:
                results[variant] = run_variant(variant, args.rate, args.seconds, Path(tmp))
                r = results[variant]
                print(f"round {index + 1} {variant:16s} Envoy added p50 "
                      f"{r['envoy_added_p50_ms']:6.3f} p99 {r['envoy_added_p99_ms']:6.3f} ms | "
                      f"client p50 {r['p50_ms']:6.3f} p99 {r['p99_ms']:6.3f} ms  "
                      f"n={r['requests']} failed={r['failed']}", flush=True)
            rounds.append(results)
    summary = summarise(rounds)
    print(f"\nEnvoy's added time at {args.rate:.0f} req/s, and what each feature adds to it "
          f"(median over {args.rounds} rounds, [min..max]):")
    for variant, entry in summary.items():
        line = (f"  {variant:16s} added p50 {entry['envoy_added_p50_ms']:.3f} ms  "
                f"p99 {entry['envoy_added_p99_ms']:.3f} ms")
        if variant != "baseline":
            for stat in ("p50", "p99"):
                delta = entry[f"added_envoy_added_{stat}_ms"]
                low, high = entry[f"added_envoy_added_{stat}_ms_spread"]
                line += f" | +{stat} {delta:+.3f} [{low:+.3f}..{high:+.3f}]"
            line += f" | failed {entry['failed']}"
        print(line)
    document = {"benchmark": "request_features", "rate": args.rate, "seconds": args.seconds,
                "rounds_count": args.rounds, "machine": {"python": platform.python_version(),
                                                         "cpus": os.cpu_count()},
                "summary": summary, "rounds": rounds}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
