"""Fixtures for the end-to-end tests.

One *stack* per xDS flavour (``sotw``, ``delta``), shared by the tests of a module: five fake
backends (pool ``alpha`` has three, pool ``beta`` two), ``trimtab serve`` as a subprocess
(through ``tests.support.launcher``, with its hooks server) and a real Envoy that takes
everything over ADS. The function-scoped ``stack`` fixture puts the shared stack back into its baseline state before each test (trimtab
running, hooks off, every backend healthy at its baseline memory, Envoy showing those weights),
so a test's outcome never depends on the tests that ran before it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support import BackendFleet
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess, XdsApi, free_port, render_bootstrap

INTERVAL_S = 0.5  # telemetry.interval_seconds: short, to keep the tests fast
STALE_AFTER_S = 3.0  # telemetry.stale_after_seconds: several ticks
SLACK_S = 1.0  # push + apply + scheduling allowance on top of a tick (busy 2-core CI box)
SETTLE_S = 15.0  # generous deadline for states that have no timing requirement
TOTAL_MIB = 80_000
MODELS = {"alpha": "example/alpha-8b", "beta": "example/beta-70b"}
POOL_SIZES = {"alpha": 3, "beta": 2}
BASELINE_PCT = {"alpha": (10.0, 50.0, 90.0), "beta": (30.0, 70.0)}  # -> 95/75/55, 85/65
TRIMTAB_STOP_S = 5.0
ROOT = Path(__file__).resolve().parents[2]  # the checkout: `tests` is importable from here


def expected_weight(used_mib: float, total_mib: float) -> int:
    """The documented formula, computed independently of trimtab's code."""
    pct = 100.0 * used_mib / total_mib
    return max(1, min(100, round(100 - pct / 2)))


def parse_metric(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in a Prometheus text page, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def http_json(url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@dataclass
class TrimtabProcess:
    """``python -m xds_server.cli serve`` as a child process, stopped by PID. With a
    ``hooks_port``, ``python -m tests.support.launcher`` instead: the same serve path with a
    hooked controller, its hooks server on that port (see :meth:`set_invalid_weight`)."""

    config_path: Path
    admin_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    hooks_port: int | None = None

    def start(self) -> None:
        assert not self.running(), "trimtab already running"
        cmd = ([sys.executable, "-m", "xds_server.cli", "serve", "--config", str(self.config_path)]
               if self.hooks_port is None else
               [sys.executable, "-m", "tests.support.launcher", "--config", str(self.config_path),
                "--hooks", f"127.0.0.1:{self.hooks_port}"])
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=ROOT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.admin_port}{path}"

    def _ready(self) -> bool:
        if not self.running():
            raise AssertionError(f"trimtab exited early; log tail:\n{self.log_tail()}")
        try:
            return http_json(self.url("/readyz"), timeout=1.0)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = SETTLE_S) -> None:
        wait_until(self._ready, timeout, "trimtab /readyz 200")

    def ticks(self) -> int:
        return int(http_json(self.url("/readyz"))[1]["ticks"])

    def wait_ticks(self, count: int, since: int | None = None) -> None:
        """Wait until ``count`` ticks have run after tick number ``since`` (default: now)."""
        target = (self.ticks() if since is None else since) + count
        wait_until(self.ticks, count * INTERVAL_S + SETTLE_S, f"tick {target}",
                   check=lambda ticks: ticks >= target)

    def weights(self) -> dict[str, Any]:
        return http_json(self.url("/v1/weights"))[1]

    def metric(self, name: str, **labels: str) -> float | None:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5.0) as resp:
            return parse_metric(resp.read().decode(), name, **labels)

    def set_invalid_weight(self, pool: str, enabled: bool) -> dict[str, Any]:
        assert self.hooks_port is not None, "started without hooks"
        status, body = http_json(f"http://127.0.0.1:{self.hooks_port}/invalid-weight",
                                 {"pool": pool, "enabled": enabled})
        assert status == 200, body
        return body

    def stop(self, sig: int = signal.SIGTERM, timeout: float = TRIMTAB_STOP_S) -> int | None:
        """Signal, wait, then SIGKILL. Returns the exit status, or None if it had to be killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is not None:
            return proc.returncode
        os.kill(proc.pid, sig)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
            return None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Stack:
    """Backends + trimtab + Envoy for one xDS flavour."""

    api: XdsApi
    fleet: BackendFleet
    trimtab: TrimtabProcess
    envoy: EnvoyProcess
    listener_port: int
    xds_port: int
    members: dict[str, list[int]] = field(default_factory=dict)  # pool -> fleet indices

    def addresses(self, pool: str) -> list[str]:
        return [self.fleet.addresses[i] for i in self.members[pool]]

    def set_pct(self, pool: str, position: int, pct: float) -> None:
        self.fleet.set_memory(self.members[pool][position], round(TOTAL_MIB * pct / 100), TOTAL_MIB)

    def set_pcts(self, pool: str, pcts: tuple[float, ...]) -> None:
        for position, pct in enumerate(pcts):
            self.set_pct(pool, position, pct)

    def expected(self, pool: str) -> dict[str, int]:
        """What the formula gives for the memory the backends report now."""
        out = {}
        for index in self.members[pool]:
            backend = self.fleet.backends[index]
            out[backend.address] = expected_weight(backend.used_mib, backend.total_mib)
        return out

    def envoy_weights(self, pool: str) -> dict[str, int]:
        return self.envoy.host_weights(pool)

    def wait_envoy(self, pool: str, want: dict[str, int], timeout: float = SETTLE_S) -> float:
        """Poll Envoy until ``pool`` has exactly ``want``; returns when (monotonic)."""
        wait_until(lambda: self.envoy_weights(pool), timeout, f"Envoy {pool} weights {want}",
                   check=lambda weights: weights == want, every=0.01)
        return time.monotonic()

    def stat(self, name: str) -> int:
        value = self.envoy.stat(name)
        return 0 if value is None else value

    def reset(self) -> None:
        """Back to the baseline: trimtab up, hooks off, healthy backends, baseline weights."""
        if not self.trimtab.running():
            self.trimtab.start()
            self.trimtab.wait_ready()
        self.trimtab.set_invalid_weight("alpha", False)
        for index in range(len(self.fleet.backends)):
            self.fleet.set_metrics_mode(index, "ok")
        for pool, pcts in BASELINE_PCT.items():
            self.set_pcts(pool, pcts)
        for pool in BASELINE_PCT:
            self.wait_envoy(pool, self.expected(pool))
        wait_until(lambda: self.envoy.stat("control_plane.connected_state"), SETTLE_S,
                   "Envoy connected to trimtab", check=lambda state: state == 1)
        wait_until(self.trimtab.weights, SETTLE_S, "no stale endpoint", check=_nothing_stale)


def _nothing_stale(document: dict[str, Any]) -> bool:
    return not any(ep["stale"] for pool in document["pools"].values() for ep in pool.values())


def write_config(path: Path, fleet: BackendFleet, ports: dict[str, int]) -> dict[str, list[int]]:
    """The trimtab config for the stack; returns pool -> fleet indices."""
    members, pools, start = {}, [], 0
    for name, size in POOL_SIZES.items():
        members[name] = list(range(start, start + size))
        start += size
        pools.append({"name": name, "model": MODELS[name], "lb_policy": "round_robin",
                      "endpoints": [{"address": fleet.addresses[i]} for i in members[name]]})
    config = {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": INTERVAL_S, "stale_after_seconds": STALE_AFTER_S},
        # the stack's expected weights follow the seed's formula from the backends' pages
        "weights": {"policy": "gpu_memory"},
        "pools": pools,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return members


INTENT_ROLES = ["intent", "intent-code", "plain"]  # the classifier stacks' pools, in fleet order


def intent_tier_config(fleet: BackendFleet, ports: dict[str, int], **classifier: Any
                       ) -> dict[str, Any]:
    """The config of the classifier e2e stacks: pool `intent` sends tier `code` to
    `intent-code` (same model), `plain` has no tiers; ``classifier`` is the classifier
    section (its address is ``ports["classifier"]``)."""
    def pool(name: str, model: str, **extra: Any) -> dict[str, Any]:
        address = fleet.addresses[INTENT_ROLES.index(name)]
        return {"name": name, "model": model, "endpoints": [{"address": address}], **extra}

    return {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": 0.5, "stale_after_seconds": 3.0},
        "classifier": {"address": f"127.0.0.1:{ports['classifier']}", **classifier},
        "pools": [pool("intent", "m-intent", intent_tiers={"code": "intent-code"}),
                  pool("intent-code", "m-intent"), pool("plain", "m-plain")],
    }


@pytest.fixture(scope="module", params=["sotw", "delta"])
def shared_stack(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    api: XdsApi = request.param
    workdir = tmp_path_factory.mktemp(f"e2e-{api}")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    fleet = BackendFleet(sum(POOL_SIZES.values())).start()
    trimtab = envoy = None
    try:
        members = write_config(workdir / "trimtab.yaml", fleet, ports)
        trimtab = TrimtabProcess(workdir / "trimtab.yaml", ports["admin"], workdir / "trimtab.log",
                                 hooks_port=free_port())
        envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
        bootstrap = render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api=api)
        stack = Stack(api, fleet, trimtab, envoy, ports["listener"], ports["xds"], members)
        for pool, pcts in BASELINE_PCT.items():
            stack.set_pcts(pool, pcts)
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(bootstrap, workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        yield stack
    finally:
        _teardown(trimtab, envoy, fleet)


def _teardown(trimtab: TrimtabProcess | None, envoy: EnvoyProcess | None,
              fleet: BackendFleet) -> None:
    pids = [p.pid for p in (trimtab.proc if trimtab else None, envoy.proc if envoy else None) if p]
    try:
        if envoy is not None:
            envoy.stop()
        if trimtab is not None:
            trimtab.stop()
    finally:
        fleet.stop()
    leftovers = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture
def stack(shared_stack: Stack, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The shared stack, reset to its baseline; on failure the trimtab log tail is printed."""
    shared_stack.reset()
    yield shared_stack
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"--- trimtab log tail ({shared_stack.api}) ---\n{shared_stack.trimtab.log_tail()}")
        print(f"--- envoy log tail ---\n{shared_stack.envoy.log_tail()}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
