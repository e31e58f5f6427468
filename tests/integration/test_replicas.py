"""Replicas: two `trimtab serve` processes with the same config and telemetry agree byte for
byte, and a real Envoy moved from one to the other sees no change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import wait_for
from xds_server.envoy_process import EnvoyProcess, free_port, render_bootstrap

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
            wait_for(lambda port=port: _ready(port), 20, f"replica on {port} ready")
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
        before = wait_for(lambda: {c: envoy.stat(c) for c in counters}, 10,
                          "Envoy holding every pool", lambda v: all(v.values()))
        weights = envoy.host_weights("pool1")
        serving = next(i for i in range(2) if _streams(admin[i]) > 0)
        procs[serving].send_signal(signal.SIGTERM)
        procs[serving].wait(10)
        other = 1 - serving
        wait_for(lambda: _streams(admin[other]), 20, "Envoy reconnected to the other replica")
        wait_for(lambda: _acked(admin[other]), 10, "the other replica saw Envoy's ACKs")
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
