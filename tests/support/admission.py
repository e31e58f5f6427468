"""Admission end-to-end stacks: fake vLLM servers that hold every request, ``trimtab serve``
with a pool's admission config, and a real Envoy; and the client side of a burst."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.integration.conftest import TrimtabProcess
from tests.support.backends import BackendFleet, VllmPage
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap

Reply = tuple[int, float, dict[str, str], bytes]  # status, seconds, headers, body
Stack = tuple[BackendFleet, TrimtabProcess, EnvoyProcess, int]


def write_config(path: Path, fleet: BackendFleet, ports: dict[str, int], pool: dict[str, Any],
                 interval_s: float) -> None:
    """``trimtab serve``'s config: one pool (``pool``'s keys) over the fleet's servers."""
    config = {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": interval_s, "stale_after_seconds": 3.0},
        "pools": [{**pool, "endpoints": [{"address": a} for a in fleet.addresses]}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@contextmanager
def admission_stack(workdir: Path, pages: Sequence[VllmPage], hold_s: float,
                    pool: dict[str, Any], interval_s: float, settle_s: float) -> Iterator[Stack]:
    """One fake server per page, each holding every request ``hold_s``; trimtab with
    ``pool``; Envoy. Everything is stopped by PID, and checked gone, on the way out."""
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    fleet = BackendFleet(len(pages)).start()
    trimtab = TrimtabProcess(workdir / "trimtab.yaml", ports["admin"], workdir / "trimtab.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
    try:
        for index, page in enumerate(pages):
            fleet.set_vllm(index, page)
            fleet.backends[index].response_delay_s = hold_s
        write_config(workdir / "trimtab.yaml", fleet, ports, pool, interval_s)
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"]), workdir / "envoy.log")
        envoy.wait_ready(timeout=settle_s)
        yield fleet, trimtab, envoy, ports["listener"]
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc) if p is not None]
        envoy.stop()
        trimtab.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


def envoy_runtime(envoy: EnvoyProcess) -> dict[str, str]:
    """Envoy's runtime: key -> final value."""
    entries = json.loads(envoy.admin_get("/runtime"))["entries"]
    return {k: v.get("final_value", "") for k, v in entries.items()}


def envoy_counters(envoy: EnvoyProcess) -> dict[str, int]:
    """Envoy's integer stats by name."""
    out = {}
    for line in envoy.admin_get("/stats").splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def post_chat(port: int, model: str, headers: dict[str, str] | None = None) -> Reply:
    """One chat completion through Envoy; an HTTP error is a reply, not an exception."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"content-type": "application/json", **(headers or {})})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, time.perf_counter() - started, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, time.perf_counter() - started, dict(exc.headers), exc.read()


def burst(port: int, model: str, headers: Sequence[dict[str, str] | None]) -> list[Reply]:
    """One request per entry of ``headers``, all at once."""
    def send(h: dict[str, str] | None) -> Reply:
        return post_chat(port, model, h)

    with ThreadPoolExecutor(len(headers)) as pool:
        return list(pool.map(send, headers))
