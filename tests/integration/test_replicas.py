"""Replicas: two `trimtab serve` processes with the same config and telemetry agree byte for
byte, and a real Envoy moved from one to the other sees no change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import TrimtabProcess
from tests.integration.test_routing_features import Traffic
from tests.support import BackendFleet, VllmPage
from tests.support.fake_kube import FakeKube
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap
from xds_server.control.rollouts.machine import from_json

pytestmark = pytest.mark.slow


def _config(tmp: Path, name: str, xds: int, admin: int, listener: int) -> Path:
    pools = [{"name": f"pool{p}", "model": f"model-{p}", "telemetry_source": "static",
              "endpoints": [{"address": f"127.0.0.{p + 1}:{9000 + e}",
                             "signals": {"gpu_mem_pct": 10.0 * e + p}} for e in range(3)]}
             for p in range(3)]
    config = {"xds": {"address": f"127.0.0.1:{xds}"}, "admin": {"address": f"127.0.0.1:{admin}"},
              "listener": {"address": f"127.0.0.1:{listener}"},
              "telemetry": {"interval_seconds": 0.5}, "pools": pools,
              "rollouts": {"state_file": str(tmp / f"{name}-rollouts.json")}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "xds_server.cli", "--log-level", "warning",
                             "serve", "--config", str(path)], env=dict(os.environ))


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read()


def _snapshot(admin: int) -> dict:
    return json.loads(_get(f"http://127.0.0.1:{admin}/v1/snapshot"))["current"]


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[list[int], list[int], list[subprocess.Popen[bytes]]]]:
    listener = free_port()
    xds, admin = [free_port(), free_port()], [free_port(), free_port()]
    procs = [_start(_config(tmp_path, f"r{i}", xds[i], admin[i], listener)) for i in range(2)]
    try:
        for port in admin:
            wait_until(lambda port=port: _ready(port), 20, f"replica on {port} ready")
        yield xds, admin, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


def _ready(admin: int) -> bool:
    try:
        _get(f"http://127.0.0.1:{admin}/readyz")
        return True
    except OSError:
        return False


def test_two_replicas_publish_identical_versions(replicas):
    _, admin, _ = replicas
    a, b = _snapshot(admin[0]), _snapshot(admin[1])
    assert a["version"] == b["version"]
    assert a["types"] == b["types"]  # every resource name and content-hash version


def test_envoy_moved_between_replicas_sees_no_change(replicas, tmp_path):
    xds, admin, procs = replicas
    bootstrap = render_bootstrap(xds_host="127.0.0.1", xds_port=xds[0], admin_port=free_port())
    endpoints = bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"]
    second = {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                          "port_value": xds[1]}}}}
    endpoints[0]["lb_endpoints"].append(second)  # Envoy fails over to the other replica
    with EnvoyProcess() as envoy:
        envoy.start(bootstrap, log_path=tmp_path / "envoy.log")
        envoy.wait_ready(20)
        counters = ("cluster_manager.cds.update_success", "listener_manager.lds.update_success",
                    "cluster.pool0.update_success", "cluster.pool1.update_success")
        before = wait_until(lambda: {c: envoy.stat(c) for c in counters}, 10,
                            "Envoy holding every pool", lambda v: all(v.values()))
        weights = envoy.host_weights("pool1")
        serving = next(i for i in range(2) if _streams(admin[i]) > 0)
        procs[serving].send_signal(signal.SIGTERM)
        procs[serving].wait(10)
        other = 1 - serving
        wait_until(lambda: _streams(admin[other]), 20, "Envoy reconnected to the other replica")
        wait_until(lambda: _acked(admin[other]), 10, "the other replica saw Envoy's ACKs")
        assert {c: envoy.stat(c) for c in counters} == before
        assert envoy.host_weights("pool1") == weights


def _streams(admin: int) -> int:
    try:
            return len(json.loads(_get(f"http://127.0.0.1:{admin}/v1/snapshot"))["streams"])
    except OSError:
        return 0


def _acked(admin: int) -> bool:
    streams = json.loads(_get(f"http://127.0.0.1:{admin}/v1/snapshot"))["streams"]
    return any(t["acked_version"] for s in streams for t in s["types"].values())


# -- three replicas on (fake) Kubernetes: Lease leader election, state in a ConfigMap ----------

LEASE_S, RENEW_S, TICK_S = 2, 0.2, 0.5
KILL_RAMP = {"start_percent": 20, "step_percent": 20, "step_interval_seconds": 1.5,
             "max_percent": 100, "gates": {"min_requests": 5, "ttft_p95_tolerance": 0.5,
                                           "error_rate_tolerance": 0.05}}
MEASURE_SLACK_S = 0.5  # polling /readyz and process scheduling on a busy 2-core box


def _coordinated_config(tmp: Path, index: int, ports: dict[str, Any], kube_host: str,
                        stable: str, canary: str) -> Path:
    config = {
        "xds": {"address": f"127.0.0.1:{ports['xds'][index]}"},
        "admin": {"address": f"127.0.0.1:{ports['admin'][index]}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": TICK_S, "stale_after_seconds": 3.0},
        "coordination": {"kubernetes": {"namespace": "trimtab", "lease_seconds": LEASE_S,
                                        "renew_seconds": RENEW_S, "identity": f"r{index}",
                                        "api_server": kube_host}},
        "rollouts": {"state_file": str(tmp / f"unused-{index}.json")},
        "pools": [{"name": "ramp", "model": "m-ramp", "rollout": KILL_RAMP,
                   "versions": {"stable": {"endpoints": [{"address": stable}]},
                                "canary": {"endpoints": [{"address": canary}]}}}],
    }
    path = tmp / f"r{index}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _leader_doc(process: Any) -> dict[str, Any] | None:
    try:
        return json.loads(_get(process.url("/readyz")))["leader"]
    except OSError:
        return None


def _leaders(replicas: list[Any]) -> list[int]:
    return [i for i, r in enumerate(replicas)
            if r.running() and (_leader_doc(r) or {}).get("leading")]


def test_leader_killed_mid_rollout_a_follower_resumes_every_step_exactly_once(tmp_path):
    ports: dict[str, Any] = {"xds": [free_port() for _ in range(3)],
                             "admin": [free_port() for _ in range(3)],
                             "listener": free_port(), "envoy_admin": free_port()}
    with FakeKube() as kube, BackendFleet(2) as fleet:
        for index in range(2):
            fleet.set_vllm(index, VllmPage(kv_usage=0.2, ttft_s=0.05))
        stable, canary = fleet.addresses
        replicas = [TrimtabProcess(_coordinated_config(tmp_path, i, ports, kube.host, stable,
                                                       canary),
                                   ports["admin"][i], tmp_path / f"r{i}.log")
                    for i in range(3)]
        bootstrap = render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"][0],
                                     admin_port=ports["envoy_admin"])
        lb = bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
        for port in ports["xds"][1:]:  # Envoy fails over to the other replicas
            lb["lb_endpoints"].append({"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port}}}})
        envoy = EnvoyProcess()
        try:
            for replica in replicas:
                replica.start()
            for replica in replicas:  # three imports at once on a busy box: be patient
                replica.wait_ready(60)
            envoy.start(bootstrap, log_path=tmp_path / "envoy.log")
            envoy.wait_ready(20)
            wait_until(lambda: envoy.stat("cluster.ramp-canary.membership_total"), 20,
                       "Envoy holding the canary cluster")
            with Traffic(ports["listener"], "m-ramp") as traffic:
                (leader,) = wait_until(lambda: _leaders(replicas), 10, "one leader",
                                       check=lambda found: len(found) == 1)
                wait_until(lambda: _rollout(replicas[leader]), 20, "the first step",
                           check=lambda s: s is not None and s["step"] >= 1)
                os.kill(replicas[leader].proc.pid, signal.SIGKILL)  # mid-rollout
                killed_at = time.monotonic()
                replicas[leader].proc.wait(5)
                (new,) = wait_until(lambda: _leaders(replicas), LEASE_S + TICK_S + 5,
                                    "a follower leading", check=lambda found: len(found) == 1)
                took = time.monotonic() - killed_at
                follower = next(i for i in range(3) if i not in (leader, new))
                leading_metric = [replicas[i].metric("trimtab_leader", identity=f"r{i}")
                                  for i in (new, follower)]
                held_by = (_leader_doc(replicas[follower]) or {}).get("leader")
                final = wait_until(lambda: _rollout(replicas[new]), 30, "promotion",
                                   check=lambda s: s is not None and s["phase"] == "promoted")
                traffic.stop()
                answered, failed = traffic.counts()
                lease_holder = kube.get_object("leases", "trimtab-leader",
                                               "trimtab")["spec"]["holderIdentity"]
            survivors = [r for r in replicas if r.running()]
            for replica in survivors:  # the followers route by the same state
                wait_until(lambda replica=replica: _rollout(replica), 5, "followers promoted",
                           check=lambda s: s is not None and s["phase"] == "promoted")
        finally:
            envoy.stop()
            for replica in replicas:
                replica.stop()
        print(f"leader r{leader} killed; r{new} led after {took:.2f}s; "
              f"{sum(answered.values())} requests answered, {failed} failed")
        assert new != leader
        assert leading_metric == [1.0, 0.0]
        assert held_by in (f"r{new}", f"r{leader}")  # it may not have seen the takeover yet
        assert lease_holder == f"r{new}"
        released = kube.get_object("leases", "trimtab-leader", "trimtab")
        assert released is not None and "holderIdentity" not in released["spec"]  # SIGTERM
        assert took <= LEASE_S + TICK_S + MEASURE_SLACK_S, took
        assert failed == 0 and sum(answered.values()) > 100, (answered, traffic.failures[:5])
        assert answered[canary] > 0 and answered[stable] > 0
        steps = [line for i in range(3) for line in
                 (tmp_path / f"r{i}.log").read_text().splitlines()
                 if "rollout ramp: step at" in line]
        percents = sorted(int(line.split("step at ")[1].split("%")[0]) for line in steps)
        assert percents == [40, 60, 80, 100], steps  # every step once, across the replicas
        promotes = [i for i in range(3) if "rollout ramp: promote at"
                    in (tmp_path / f"r{i}.log").read_text()]
        assert promotes == [new]
        stored = kube.get_object("configmaps", "trimtab-rollouts", "trimtab")
        assert stored is not None
        state = from_json(stored["data"]["rollouts.json"])["ramp"]
        assert [e.percent for e in state.history if e.kind == "step"] == [40, 60, 80, 100]
        assert final["step"] == 4 and state.phase == "promoted"
        assert not [w for w in kube.object_records("configmaps", "replace")
                    if not w.resource_version]  # every write was over a version read


def _rollout(process: Any) -> dict[str, Any] | None:
    try:
        return json.loads(_get(process.url("/v1/rollouts")))["rollouts"].get("ramp")
    except OSError:
        return None
