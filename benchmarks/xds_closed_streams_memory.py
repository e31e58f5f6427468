"""What closed xDS streams leave in the server's memory (issue 12, §2).

    .venv/bin/python -m benchmarks.xds_closed_streams_memory              # 3 rounds x 30 streams x 100k
    .venv/bin/python -m benchmarks.xds_closed_streams_memory --rounds 2 --streams 30 --names 100000

The trimtab server (grpc.aio `XdsServicer` + `SnapshotCache`, a 100-pool x 100-endpoint snapshot
built by the real `Controller`) runs in its own process, with `max_resource_names` raised above
`--names` so the streams are accepted (with the default limit they are refused: the run checks
that once too). Per round, `--streams` SotW ADS streams each subscribe EDS to one real cluster
plus `--names` made-up names of their own, wait for their answer, and close. The server's RSS
(VmRSS) is read before the first round, while each round's streams are open, and once they
have all closed (its stream count back to 0 and its heap trimmer run, no forced garbage
collection; then once more after a `gc.collect()`). The worst event-loop lag (a 5 ms timer) of
the server while the streams open, and while they close and are trimmed, is reported too. The snapshot is never replaced, so nothing but the closing can free
what the streams held. Results: a table on stdout and
`benchmarks/results/xds_closed_streams_memory.json`.

Target (issue 12): the closed streams leave RSS within +150 MB of where it started.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from envoy.service.discovery.v3 import discovery_pb2

from benchmarks.xds_fanout import make_controller, snapshot_of, synthetic_config
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.server import XdsServicer, start_xds_server

try:  # issue 12's limits; absent on older code (then the run measures that code as it is)
    from xds_server.xds.protocol import StreamLimits
except ImportError:  # pragma: no cover - only when benchmarking the code before the fix
    StreamLimits = None  # type: ignore[assignment,misc]

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
RESULTS = Path(__file__).with_name("results") / "xds_closed_streams_memory.json"
TARGET_MB = 150.0


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


# --- the server process ------------------------------------------------------------------

def server_main(conn: Connection, max_names: int | None) -> None:
    asyncio.run(_serve(conn, max_names))


async def _serve(conn: Connection, max_names: int | None) -> None:
    cache = SnapshotCache()
    cache.set_snapshot(snapshot_of(make_controller(synthetic_config(100, 100), SnapshotCache())))
    limits = (StreamLimits(max_resource_names=max_names)
              if StreamLimits is not None and max_names is not None else None)
    servicer = XdsServicer(cache, limits=limits) if limits is not None else XdsServicer(cache)
    server, port = await start_xds_server(servicer, "127.0.0.1:0")
    loop = asyncio.get_running_loop()
    lag = [0.0]  # the worst delay of a 5 ms timer since the last "lag" command
    monitor = asyncio.create_task(_watch_lag(lag))
    conn.send(port)
    try:
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                return
            if command == "gc":
                gc.collect()
            assert cache.snapshot is not None
            heap = getattr(servicer, "heap", None)  # absent before issue 12's fix
            conn.send({"streams": len(servicer.streams), "snapshot": cache.snapshot.version,
                       "rss_mb": rss_mb(), "trims": heap.trims if heap is not None else None,
                       "trim_s": heap.last_seconds if heap is not None else None,
                       "loop_lag_ms": lag[0] * 1000})
            if command == "lag":
                lag[0] = 0.0
    finally:
        monitor.cancel()
        await server.stop(None)


async def _watch_lag(worst: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(0.005)
        worst[0] = max(worst[0], loop.time() - started - 0.005)


class Server:
    def __init__(self, max_names: int | None) -> None:
        self.conn, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=server_main, args=(child, max_names),
                                                    daemon=True)
        self.proc.start()
        self.port = self.conn.recv()

    def state(self, command: str = "state") -> dict[str, Any]:
        self.conn.send(command)
        return self.conn.recv()

    def wait_streams(self, count: int, trims: int | None = None,
                     timeout: float = 60.0) -> dict[str, Any]:
        """Until the server has `count` streams (and, if given, more than `trims` trims)."""
        deadline = time.monotonic() + timeout
        while True:
            state = self.state()
            if state["streams"] == count and (trims is None or state["trims"] is None
                                              or state["trims"] > trims):
                return state
            if time.monotonic() > deadline:
                raise RuntimeError(f"server has {state['streams']} streams, not {count}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# --- the clients -------------------------------------------------------------------------

async def open_streams(port: int, streams: int, names: int, round_no: int,
                       ) -> tuple[list[grpc.aio.Channel], list[Any], list[str]]:
    """`streams` streams, each subscribed to pool-0000 and `names` made-up names; returns
    once every one got its answer (or its error)."""
    channels, calls, outcomes = [], [], []
    for i in range(streams):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                            options=[("grpc.use_local_subchannel_pool", 1)])
        call = channel.stream_stream(ADS)()
        made_up = [f"made-up-{round_no}-{i}-{n:07d}" for n in range(names)]
        request = discovery_pb2.DiscoveryRequest(
            node={"id": f"mem-{round_no}-{i}"}, type_url=type_urls.ENDPOINT,
            resource_names=["pool-0000", *made_up])
        await call.write(request.SerializeToString())
        channels.append(channel)
        calls.append(call)
    for call in calls:
        try:
            raw = await asyncio.wait_for(call.read(), 60)
            got = discovery_pb2.DiscoveryResponse.FromString(raw)
            outcomes.append(f"ok:{len(got.resources)}")
        except grpc.aio.AioRpcError as exc:
            outcomes.append(exc.code().name)
    return channels, calls, outcomes


async def close_streams(channels: list[grpc.aio.Channel], calls: list[Any]) -> None:
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()


def run_round(server: Server, streams: int, names: int, round_no: int) -> dict[str, Any]:
    async def go() -> tuple[list[str], dict[str, Any]]:
        channels, calls, outcomes = await open_streams(server.port, streams, names, round_no)
        state_open = server.state("lag")  # the lag while opening; from here, while closing
        await close_streams(channels, calls)
        return outcomes, state_open

    server.state("lag")
    outcomes, state_open = asyncio.run(go())
    closed = server.wait_streams(0, trims=state_open["trims"])
    collected = server.state("gc")
    return {"round": round_no, "outcomes": sorted(set(outcomes)),
            "rss_open_mb": state_open["rss_mb"], "streams_open": state_open["streams"],
            "rss_closed_mb": closed["rss_mb"], "rss_closed_after_gc_mb": collected["rss_mb"],
            "trim_s": closed["trim_s"], "loop_lag_while_opening_ms": state_open["loop_lag_ms"],
            "loop_lag_while_closing_ms": closed["loop_lag_ms"],
            "snapshot": closed["snapshot"]}


def measure(rounds: int, streams: int, names: int) -> dict[str, Any]:
    server = Server(max_names=names + 1)
    try:
        start = server.wait_streams(0)
        rows = [run_round(server, streams, names, r) for r in range(1, rounds + 1)]
    finally:
        server.stop()
    growth = max(row["rss_closed_mb"] for row in rows) - start["rss_mb"]
    return {"start_rss_mb": start["rss_mb"], "snapshot": start["snapshot"], "rounds": rows,
            "snapshot_unchanged": all(row["snapshot"] == start["snapshot"] for row in rows),
            "worst_growth_after_close_mb": growth, "target_mb": TARGET_MB,
            "within_target": growth <= TARGET_MB}


def default_limit_check(names: int) -> dict[str, Any]:
    """With the default `max_resource_names`, one such stream is refused."""
    server = Server(max_names=None)
    try:
        async def go() -> list[str]:
            channels, calls, outcomes = await open_streams(server.port, 1, names, 0)
            await close_streams(channels, calls)
            return outcomes
        return {"outcome": asyncio.run(go())[0]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--names", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = {"streams_per_round": args.streams, "names_per_stream": args.names,
              **measure(args.rounds, args.streams, args.names),
              "default_limit": default_limit_check(args.names)}
    print(f"server RSS at start: {result['start_rss_mb']:.0f} MB; "
          f"{args.streams} streams x {args.names:,} made-up EDS names per round")
    print(f"{'round':>5} {'open MB':>8} {'closed MB':>9} {'after gc MB':>11} {'trim ms':>7} "
          f"{'lag open/close ms':>17}  outcomes")
    for row in result["rounds"]:
        trim = f"{row['trim_s'] * 1000:.1f}" if row["trim_s"] is not None else "-"
        print(f"{row['round']:>5} {row['rss_open_mb']:>8.0f} {row['rss_closed_mb']:>9.0f} "
              f"{row['rss_closed_after_gc_mb']:>11.0f} {trim:>7} "
              f"{row['loop_lag_while_opening_ms']:>8.1f}/{row['loop_lag_while_closing_ms']:<8.1f}"
              f"  {', '.join(row['outcomes'])}")
    print(f"worst RSS growth after close: {result['worst_growth_after_close_mb']:+.0f} MB "
          f"(target +{TARGET_MB:.0f} MB): {'met' if result['within_target'] else 'NOT met'}; "
          f"snapshot unchanged: {result['snapshot_unchanged']}")
    print(f"with the default max_resource_names: {result['default_limit']['outcome']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    main()
