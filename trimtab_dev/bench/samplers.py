"""Telemetry sampled while a benchmark runs: trimtab's weights, Envoy's per-host weights and
in-flight requests, the simulator's stats, each on its own period."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from trimtab_dev.bench import envoy_configs
from trimtab_dev.bench.stack import PolicyStack

Clock = Callable[[], float]


# ---- telemetry samplers -------------------------------------------------------------------
@dataclass
class Sampler:
    """GETs ``url`` every ``every`` seconds; keeps ``(t, transform(json))``."""

    name: str
    url: str
    every: float
    transform: Callable[[Any], Any]
    samples: list[tuple[float, Any]] = field(default_factory=list)
    errors: int = 0

    async def run(self, session: aiohttp.ClientSession, clock: Clock) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.every, 1.0))
        tick = 0
        while True:
            try:
                async with session.get(self.url, timeout=timeout) as resp:
                    data = await resp.json(content_type=None)
                self.samples.append((round(clock(), 3), self.transform(data)))
            except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
                self.errors += 1
            tick += 1
            await asyncio.sleep(max(0.0, tick * self.every - clock()))


def trimtab_weights(document: dict[str, Any]) -> dict[str, Any]:
    """``/v1/weights`` -> ``{address: {weight, health, signals}}`` of the bench pool."""
    pool = document["pools"][envoy_configs.CLUSTER]
    return {address: {"weight": e["weight"], "health": e.get("health"),
                      "locality": e.get("locality"),
                      "locality_weight": e.get("locality_weight"),
                      "signals": e.get("signals", {}),
                      "breakdown": {k: v for k, v in (e.get("breakdown") or {}).items()
                                    if k in BREAKDOWN_KEPT}}
            for address, e in pool.items()}


# the queueing policy's estimates, kept per sample so a reader can see why weights moved
BREAKDOWN_KEPT = frozenset({"service_rate", "throughput", "target_rate",
                            "backlog", "predicted_wait_s", "target_weight"})


def envoy_weights(document: dict[str, Any]) -> dict[str, int]:
    """``/clusters?format=json`` -> ``{address: weight}`` of the bench cluster."""
    for status in document.get("cluster_statuses", []):
        if status.get("name") == envoy_configs.CLUSTER:
            out = {}
            for host in status.get("host_statuses", []):
                sock = host.get("address", {}).get("socket_address", {})
                out[f"{sock.get('address')}:{sock.get('port_value')}"] = int(host.get("weight", 1))
            return out
    return {}


def sim_stats(document: dict[str, Any]) -> dict[str, Any]:
    """``/sim/stats`` -> loop lag, CPU and per-server running/waiting/KV."""
    keep = ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms", "cpu_seconds",
            "cpu_percent_recent", "in_flight")
    out: dict[str, Any] = {k: document[k] for k in keep if k in document}
    out["servers"] = {s["name"]: {"running": s["running"], "waiting": s["waiting"],
                                  "kv_usage": s["kv_usage"]} for s in document["servers"]}
    return out


def samplers_for(stack: PolicyStack, interval: float, sim_every: float = 2.0) -> list[Sampler]:
    """Sim stats and Envoy's host weights always; trimtab's weights every tick when it runs."""
    out = [Sampler("sim", stack.fleet.stats_url, sim_every, sim_stats),
           Sampler("envoy_weights", f"{stack.envoy_admin_url}/clusters?format=json",
                   max(interval, 1.0), envoy_weights)]
    if stack.trimtab_admin_url is not None:
        out.append(Sampler("trimtab_weights", f"{stack.trimtab_admin_url}/v1/weights",
                           interval, trimtab_weights))
    return out
