"""Processes and load of one benchmark: the simulated fleet, Envoy (+ trimtab) per policy, and
an open-loop load with an unmeasured warm-up, sampled telemetry and a bounded tail.

Every child process is started with :class:`ChildProcess` (or :class:`EnvoyProcess`) and
stopped by PID: SIGTERM, then SIGKILL, always reaped; callers stop them in ``finally``.

The load is one open-loop schedule of ``warmup + duration`` seconds (the same seed gives the
same requests for every policy); requests scheduled in the warm-up are sent and answered but
not measured. Sending stops at the end of the schedule; a request still running ``tail_s``
seconds later is cancelled and recorded as error ``unfinished`` (a policy that leaves
requests queued for minutes fails them rather than stretching the run without bound).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from trimtab_dev.bench import envoy_configs, reference
from trimtab_dev.envoy_process import EnvoyError, EnvoyProcess, free_port
from trimtab_dev.loadgen.runner import LagProbe, RequestRecord, make_session, send_one
from trimtab_dev.loadgen.workload import Workload, build_schedule, endpoint_path, request_body

STOP_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 30.0
Clock = Callable[[], float]


class BenchError(RuntimeError):
    """A part of the benchmark could not start or stop; the message says which and why."""


# ---- child processes ----------------------------------------------------------------------
@dataclass
class ChildProcess:
    """A child process with its output in ``log_path``, stopped by PID."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.running():
            raise BenchError(f"{self.name} already running")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def check_alive(self) -> None:
        if not self.running():
            raise BenchError(f"{self.name} exited early; log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        except ProcessLookupError:
            proc.wait(timeout)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM while children are being stopped, so that a second Ctrl-C
    cannot cut the clean-up short (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cli_command(*args: str) -> list[str]:
    """``trimtab ARGS`` run with this interpreter."""
    return [sys.executable, "-m", "xds_server.cli", *args]


def http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(probe: Callable[[], bool], timeout: float, what: str,
               alive: Callable[[], None] | None = None) -> None:
    """Poll ``probe`` (exceptions count as not yet) until true; raise naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            if probe():
                return
        except (OSError, ValueError, EnvoyError):
            pass
        time.sleep(0.1)
    raise BenchError(f"timed out after {timeout:g}s waiting for {what}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


# ---- the simulated fleet ------------------------------------------------------------------
@dataclass(frozen=True)
class FleetServer:
    name: str
    gpu: str
    address: str
    kv_capacity_tokens: int


@dataclass
class Fleet:
    """What ``trimtab sim`` said in its ready line, plus the served model name."""

    model: str
    servers: list[FleetServer]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def stats_url(self) -> str:
        return f"http://{self.servers[0].address}/sim/stats"

    def name_of(self, address: str) -> str:
        return next((s.name for s in self.servers if s.address == address), address)


def parse_ready_line(text: str, model: str) -> Fleet | None:
    """The fleet from ``trimtab sim``'s ready line, or None if there is none (yet)."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "ready":
            servers = [FleetServer(s["name"], s["gpu"], s["address"],
                                   int(s.get("kv_capacity_tokens") or 0))
                       for s in event["servers"] if not s.get("dead")]
            return Fleet(model, servers)
    return None


class SimFleetProcess:
    """``trimtab sim --fleet F`` as a child process (its CPU is not the load generator's)."""

    def __init__(self, fleet_path: str | Path, model: str, workdir: Path) -> None:
        self.ready_file = workdir / "sim-ready.json"
        self.model = model
        self.child = ChildProcess("trimtab sim", cli_command(
            "sim", "--fleet", str(fleet_path), "--ready-file", str(self.ready_file)),
            workdir / "sim.log")
        self.fleet: Fleet | None = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> Fleet:
        self.ready_file.unlink(missing_ok=True)
        self.child.start()

        def ready() -> bool:
            text = self.ready_file.read_text() if self.ready_file.exists() else ""
            self.fleet = parse_ready_line(text, self.model)
            return self.fleet is not None

        wait_until(ready, timeout, "the simulator's ready line", self.child.check_alive)
        assert self.fleet is not None
        if not self.fleet.servers:
            raise BenchError("the fleet has no live server")
        return self.fleet

    def stats(self) -> dict[str, Any]:
        assert self.fleet is not None
        return dict(http_json(self.fleet.stats_url))

    def wait_drained(self, timeout: float) -> float:
        """Wait until no server runs or queues anything; returns the seconds it took."""
        started = time.monotonic()

        def idle() -> bool:
            stats = self.stats()
            return stats.get("in_flight", 0) == 0 and all(
                s["running"] == 0 and s["waiting"] == 0 for s in stats["servers"])

        wait_until(idle, timeout, "the fleet to drain", self.child.check_alive)
        return time.monotonic() - started

    def stop(self) -> None:
        with signals_deferred():
            self.child.stop()


# ---- Envoy (+ trimtab) for one policy -----------------------------------------------------
class PolicyStack:
    """Envoy in front of the fleet for one policy; for ``trimtab`` and ``reference`` also
    ``trimtab serve`` (``reference``: ``weights.policy: reference`` every
    :data:`reference.INTERVAL_S`, least_request, one pool, whatever the other arguments
    say)."""

    def __init__(self, policy: str, fleet: Fleet, workdir: Path, *, weights: str = "queueing",
                 interval: float = 2.0, listener_port: int = 0, trimtab_admin_port: int = 0,
                 composite: dict[str, Any] | None = None,
                 long_context: envoy_configs.LongContext | str | None = None,
                 lb_policy: str = "least_request", queueing: dict[str, Any] | None = None,
                 active_request_bias: float | None = None) -> None:
        if policy not in envoy_configs.POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        if policy == envoy_configs.REFERENCE:
            weights, interval, composite = reference.WEIGHTS, reference.INTERVAL_S, None
            long_context, lb_policy, queueing = None, reference.LB_POLICY, None
            active_request_bias = None
        self.lb_policy, self.queueing = lb_policy, dict(queueing or {})
        self.active_request_bias = active_request_bias
        self.policy, self.fleet, self.workdir = policy, fleet, workdir
        self.weights, self.interval, self.composite = weights, interval, dict(composite or {})
        self.long_context = long_context
        self.listener_port = listener_port or free_port()
        self.envoy_admin_port = free_port()
        self.trimtab_admin_port = trimtab_admin_port or free_port()
        self.envoy = EnvoyProcess(log_level="warning")
        self.trimtab: ChildProcess | None = None

    @property
    def listener_url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin_port}"

    @property
    def trimtab_admin_url(self) -> str | None:
        return f"http://127.0.0.1:{self.trimtab_admin_port}" if self.trimtab else None

    @property
    def via_trimtab(self) -> bool:
        return self.policy in envoy_configs.XDS_POLICIES

    def bootstrap(self, xds_port: int = 0) -> dict[str, Any]:
        if self.via_trimtab:
            return envoy_configs.dynamic_bootstrap(xds_port=xds_port,
                                                   admin_port=self.envoy_admin_port)
        return envoy_configs.static_bootstrap(self.policy, self.fleet.addresses,
                                              listener_port=self.listener_port,
                                              admin_port=self.envoy_admin_port)

    def start(self) -> None:
        """Start and wait until Envoy routes to every host of the fleet."""
        xds_port = self._start_trimtab() if self.via_trimtab else 0
        bootstrap = self.bootstrap(xds_port)
        (self.workdir / f"envoy-{self.policy}.yaml").write_text(yaml.safe_dump(bootstrap))
        self.envoy.start(bootstrap, self.workdir / f"envoy-{self.policy}.log")
        self.envoy.wait_ready(READY_TIMEOUT_S)
        count = len(self.fleet.servers)
        wait_until(lambda: len(self.envoy.host_weights(envoy_configs.CLUSTER)) == count,
                   READY_TIMEOUT_S, f"Envoy to show {count} hosts", self._alive)
        wait_until(lambda: port_open(self.listener_port), READY_TIMEOUT_S,
                   f"Envoy's listener :{self.listener_port}", self._alive)

    def _start_trimtab(self) -> int:
        xds_port = free_port()
        config = envoy_configs.trimtab_config(
            model=self.fleet.model, addresses=self.fleet.addresses, xds_port=xds_port,
            admin_port=self.trimtab_admin_port, listener_port=self.listener_port,
            weights=self.weights, interval=self.interval, composite=self.composite,
            long_context=self.long_context, lb_policy=self.lb_policy, queueing=self.queueing,
            active_request_bias=self.active_request_bias)
        name = "trimtab" if self.policy == "trimtab" else f"trimtab-{self.policy}"
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.trimtab = ChildProcess("trimtab serve", cli_command(
            "--log-level", "warning", "serve", "--config", str(path)),
            self.workdir / f"{name}.log")
        self.trimtab.start()
        wait_until(lambda: http_json(f"{self.trimtab_admin_url}/readyz", 0.5) is not None,
                   READY_TIMEOUT_S, "trimtab /readyz", self.trimtab.check_alive)
        return xds_port

    def _alive(self) -> None:
        if not self.envoy.running():
            raise BenchError(f"Envoy exited; log tail:\n{self.envoy.log_tail()}")
        if self.trimtab is not None:
            self.trimtab.check_alive()

    def close(self) -> None:
        with signals_deferred():
            try:
                self.envoy.stop(STOP_TIMEOUT_S)
            finally:
                if self.trimtab is not None:
                    self.trimtab.stop()


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
                      "signals": e.get("signals", {}),
                      "breakdown": {k: v for k, v in (e.get("breakdown") or {}).items()
                                    if k in BREAKDOWN_KEPT}}
            for address, e in pool.items()}


# the queueing policy's estimates, kept per sample so a reader can see why weights moved
BREAKDOWN_KEPT = frozenset({"service_rate", "throughput", "target_rate", "backlog",
                            "predicted_wait_s", "target_weight"})


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


# ---- the load -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadPlan:
    """One run's schedule: ``warmup + duration`` seconds at ``rate`` from ``seed``."""

    rate: float
    warmup: float
    duration: float
    seed: int
    tail_s: float

    @property
    def total(self) -> float:
        return self.warmup + self.duration


@dataclass
class LoadRun:
    """Every request of a run (warm-up included), on the run's clock (0 = first instant)."""

    records: list[RequestRecord]
    wall_s: float
    client: dict[str, float]
    unfinished: int
    started_unix: float
    samples: dict[str, list[tuple[float, Any]]] = field(default_factory=dict)


@dataclass
class Counters:
    sent: int = 0
    done: int = 0
    errors: int = 0


async def _send_all(session: aiohttp.ClientSession, w: Workload, plan: LoadPlan, url: str,
                    clock: Clock, counters: Counters,
                    on_record: Callable[[RequestRecord], None] | None
                    ) -> dict[asyncio.Task[RequestRecord], RequestRecord]:
    target = url.rstrip("/") + endpoint_path(w)
    tasks: dict[asyncio.Task[RequestRecord], RequestRecord] = {}

    def finished(task: asyncio.Task[RequestRecord]) -> None:
        if task.cancelled():
            return
        counters.done += 1
        counters.errors += task.result().error is not None
        if on_record is not None:
            on_record(task.result())

    for p in build_schedule(w, rate=plan.rate, duration=plan.total, seed=plan.seed):
        delay = p.at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(p.index, p.cls, p.prompt_tokens, p.max_tokens, scheduled_at=p.at)
        task = asyncio.create_task(send_one(session, target, request_body(p, w), w.stream,
                                            rec, clock))
        task.add_done_callback(finished)
        tasks[task] = rec
        counters.sent += 1
    return tasks


async def _finish(tasks: dict[asyncio.Task[RequestRecord], RequestRecord], clock: Clock,
                  deadline: float) -> int:
    """Wait for answers until ``deadline``; cancel the rest as ``unfinished``."""
    pending = [t for t in tasks if not t.done()]
    if pending and deadline > clock():
        _, still = await asyncio.wait(pending, timeout=deadline - clock())
        pending = list(still)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in pending:
        rec = tasks[task]
        rec.error, rec.e2e = "unfinished", clock() - rec.sent_at
    return len(pending)


async def drive(url: str, w: Workload, plan: LoadPlan, clock: Clock,
                counters: Counters | None = None,
                on_record: Callable[[RequestRecord], None] | None = None) -> LoadRun:
    """Send the plan's schedule open-loop through ``url``; see the module docstring."""
    counters = counters or Counters()
    probe = LagProbe()
    probe_task = asyncio.create_task(probe.run())
    started = time.time() - clock()
    try:
        async with make_session(w) as session:
            tasks = await _send_all(session, w, plan, url, clock, counters, on_record)
            unfinished = await _finish(tasks, clock, plan.total + plan.tail_s)
    finally:
        probe_task.cancel()
        await asyncio.gather(probe_task, return_exceptions=True)
    records = sorted(tasks.values(), key=lambda r: r.index)
    return LoadRun(records, clock(), probe.summary(), unfinished, started)


async def measure(url: str, w: Workload, plan: LoadPlan, samplers: list[Sampler],
                  counters: Counters | None = None,
                  on_record: Callable[[RequestRecord], None] | None = None) -> LoadRun:
    """:func:`drive` with the samplers running on the same clock."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return loop.time() - t0

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(s.run(session, clock)) for s in samplers]
        try:
            run = await drive(url, w, plan, clock, counters, on_record)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    run.samples = {s.name: s.samples for s in samplers}
    return run
