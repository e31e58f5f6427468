"""A fleet of simulated model servers in one asyncio process, from a YAML spec.

    async with SimFleet(load_fleet("examples/fleet-hetero.yaml")) as fleet:
        fleet.addresses  # {"h100-0": "127.0.0.1:40123", ...}

The fleet also measures its own event loop (lag of a periodic timer) and CPU time, served as
JSON on every server's ``/sim/stats``: a simulator that cannot keep up would distort every
latency it reports, so benchmarks should check it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trimtab_dev.sim.profiles import GPUS, MODELS, Efficiency, with_overrides
from trimtab_dev.sim.server import Faults, ServerConfig, SimServer


class FleetError(ValueError):
    """The fleet spec is invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FaultSpec(_Strict):
    slow: float = Field(1.0, gt=0, description="multiplies every engine step time")
    dead: bool = Field(False, description="never listen: connections are refused")
    cold_start_s: float = Field(0.0, ge=0, description="503 on every endpoint until warm")


class EfficiencySpec(_Strict):
    mbu: float | None = Field(None, gt=0, le=1)
    mfu: float | None = Field(None, gt=0, le=1)
    step_overhead_s: float | None = Field(None, ge=0)
    api_overhead_s: float | None = Field(None, ge=0)


class ServerSpec(_Strict):
    name: str = Field(min_length=1)
    gpu: str
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    count: int = Field(1, ge=1, description="replicas, named <name>-0, <name>-1, ...")
    faults: FaultSpec = FaultSpec()
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # Optional per-server override of the fleet's efficiency (e.g. prefill-heavy GPU
    # parameters); fields left out keep the fleet's values. Absent: the fleet's, unchanged.
    efficiency: EfficiencySpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ServerSpec:
        if self.gpu not in GPUS:
            raise ValueError(f"unknown gpu {self.gpu!r}; known: {', '.join(GPUS)}")
        if self.count > 1 and self.port != 0:
            raise ValueError("a server with count > 1 must use port 0")
        return self


class FleetSpec(_Strict):
    model: str = Field("meta-llama/Llama-3.1-8B-Instruct", description="served model name")
    model_profile: str = "llama-3.1-8b"
    host: str = "127.0.0.1"
    orca: bool = Field(True, description="send endpoint-load-metrics headers")
    orca_utilization: Literal["occupancy", "kv_cache", "gpu_busy", "none"] = Field(
        "occupancy", description="what the ORCA application_utilization field reports")
    max_model_len: int | None = Field(None, ge=1)
    efficiency: EfficiencySpec = EfficiencySpec()
    servers: list[ServerSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> FleetSpec:
        if self.model_profile not in MODELS:
            raise ValueError(f"unknown model_profile {self.model_profile!r}")
        names = [c.name for c in expand(self)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate server names: {', '.join(dupes)}")
        ports = [s.port for s in self.servers if s.port]
        if len(ports) != len(set(ports)):
            raise ValueError("two servers share a port")
        return self


def parse_fleet(data: Any) -> FleetSpec:
    try:
        return FleetSpec.model_validate(data)
    except ValidationError as exc:
        raise FleetError(str(exc)) from exc


def load_fleet(path: str | Path) -> FleetSpec:
    """Read and validate a fleet YAML file; raises :class:`FleetError`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise FleetError(f"cannot read {path}: {exc}") from exc
    return parse_fleet(data)


def expand(spec: FleetSpec) -> list[ServerConfig]:
    """One :class:`ServerConfig` per simulated server, replicas expanded."""
    fleet_eff = {k: v for k, v in spec.efficiency.model_dump().items() if v is not None}
    eff = Efficiency(**fleet_eff)
    model = MODELS[spec.model_profile]
    configs = []
    for s in spec.servers:
        own = s.efficiency.model_dump() if s.efficiency is not None else {}
        server_eff = Efficiency(**{**fleet_eff, **{k: v for k, v in own.items()
                                                   if v is not None}}) if own else eff
        gpu = with_overrides(GPUS[s.gpu], max_num_seqs=s.max_num_seqs,
                             max_num_batched_tokens=s.max_num_batched_tokens,
                             gpu_memory_utilization=s.gpu_memory_utilization)
        faults = Faults(**s.faults.model_dump())
        names = [s.name] if s.count == 1 else [f"{s.name}-{i}" for i in range(s.count)]
        for name in names:
            configs.append(ServerConfig(
                name=name, gpu=gpu, model=model, served_model_name=spec.model,
                host=spec.host, port=s.port, faults=faults, efficiency=server_eff,
                max_model_len=s.max_model_len or spec.max_model_len, orca=spec.orca,
                orca_utilization=spec.orca_utilization))
    return configs


class LoopMonitor:
    """Measures event-loop lag with a periodic timer, and process CPU use."""

    def __init__(self, interval: float = 0.05, keep: int = 1200) -> None:
        self.interval = interval
        self.lags: deque[float] = deque(maxlen=keep)
        self._cpu: deque[tuple[float, float]] = deque(maxlen=max(2, int(10 / interval)))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-loop-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - t0 - self.interval))
            self._cpu.append((time.monotonic(), time.process_time()))

    def snapshot(self) -> dict[str, float]:
        lags = sorted(self.lags)
        cpu_pct = 0.0
        if len(self._cpu) >= 2:
            (w0, c0), (w1, c1) = self._cpu[0], self._cpu[-1]
            cpu_pct = 100.0 * (c1 - c0) / (w1 - w0) if w1 > w0 else 0.0
        return {
            "loop_lag_p50_ms": 1e3 * _quantile(lags, 0.50),
            "loop_lag_p99_ms": 1e3 * _quantile(lags, 0.99),
            "loop_lag_max_ms": 1e3 * (lags[-1] if lags else 0.0),
            "loop_lag_samples": float(len(lags)),
            "cpu_seconds": time.process_time(),
            "cpu_percent_recent": cpu_pct,
        }


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class SimFleet:
    """Starts every server of a spec on loopback; use as ``async with``."""

    def __init__(self, spec: FleetSpec | dict | str | Path) -> None:
        if isinstance(spec, str | Path):
            spec = load_fleet(spec)
        elif isinstance(spec, dict):
            spec = parse_fleet(spec)
        self.spec = spec
        self.monitor = LoopMonitor()
        self.servers: dict[str, SimServer] = {}

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def start(self) -> None:
        self.monitor.start()
        try:
            for config in expand(self.spec):
                server = SimServer(config, stats_provider=self.stats)
                self.servers[config.name] = server
                await server.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()),
                             return_exceptions=True)
        await self.monitor.stop()

    @property
    def addresses(self) -> dict[str, str]:
        """``name -> "host:port"`` for every server, dead ones included."""
        return {name: s.address for name, s in self.servers.items()}

    @property
    def urls(self) -> dict[str, str]:
        return {name: s.url for name, s in self.servers.items()}

    def describe(self) -> list[dict[str, Any]]:
        """One row per server: name, gpu, address, url, dead, kv capacity."""
        return [{"name": name, "gpu": s.config.gpu.name, "address": s.address, "url": s.url,
                 "dead": s.config.faults.dead, "kv_capacity_tokens": s.engine.kv_capacity_tokens}
                for name, s in self.servers.items()]

    async def kill(self, name: str) -> None:
        """Stop one server: its port closes and its requests are dropped."""
        await self.servers[name].stop()

    async def revive(self, name: str, cold_start_s: float = 0.0) -> None:
        await self.servers[name].revive(cold_start_s=cold_start_s)

    def stats(self) -> dict[str, Any]:
        """What ``/sim/stats`` serves: loop lag, CPU, in-flight requests per server."""
        servers = [s.snapshot() for s in self.servers.values()]
        return {"pid": os.getpid(), **self.monitor.snapshot(),
                "in_flight": sum(int(s["in_flight"]) for s in servers),
                "servers": servers}
