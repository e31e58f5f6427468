"""EnvoyProcess and BackendFleet against the real Envoy binary."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import BackendFleet
from tests.support.paths import ROOT
from trimtab_dev.envoy_process import (
    EnvoyProcess,
    XdsApi,
    envoy_binary,
    free_port,
    render_bootstrap,
    validate_config,
)


def _get(url: str, timeout: float = 2.0, data: bytes | None = None) -> tuple[int, str]:
    with urllib.request.urlopen(url, data=data, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def _static_config(admin_port: int, backend: str) -> dict[str, Any]:
    host, port = backend.rsplit(":", 1)
    endpoint = {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}},
                "load_balancing_weight": 7}  # fmt: skip
    cluster = {"name": "backend", "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": "backend", "endpoints": [{"lb_endpoints": [endpoint]}]}}  # fmt: skip
    admin = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return {"admin": admin, "static_resources": {"clusters": [cluster]}}


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_envoy_binary_exists() -> None:
    assert os.access(envoy_binary(), os.X_OK)


def test_free_port_is_bindable() -> None:
    assert 1024 < free_port() < 65536


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_rendered_bootstrap_validates(api: XdsApi) -> None:
    config = render_bootstrap(
        xds_host="127.0.0.1", xds_port=free_port(), admin_port=free_port(), api=api
    )
    assert config["dynamic_resources"]["ads_config"]["api_type"] == (
        "GRPC" if api == "sotw" else "DELTA_GRPC"
    )
    result = validate_config(config)
    assert result.returncode == 0, result.stdout + result.stderr


def test_render_bootstrap_rejects_unknown_api() -> None:
    with pytest.raises(ValueError):
        render_bootstrap(xds_host="127.0.0.1", xds_port=1, admin_port=2, api="rest")  # type: ignore[arg-type]


@pytest.mark.slow
def test_start_ready_weights_stats_stop(tmp_path: Path) -> None:
    with BackendFleet(1) as fleet:
        envoy = EnvoyProcess()
        with envoy:
            envoy.start(_static_config(free_port(), fleet.addresses[0]), tmp_path / "envoy.log")
            envoy.wait_ready(timeout=10)
            pid = envoy.pid
            assert pid is not None and envoy.running()
            assert envoy.host_weights("backend") == {fleet.addresses[0]: 7}
            assert envoy.host_weights("missing") == {}
            assert envoy.stat("cluster.backend.membership_total") == 1
            assert envoy.stat("cluster.backend.no_such_stat") is None
        assert not envoy.running() and _gone(pid)
        envoy.stop()  # idempotent


@pytest.mark.slow
def test_dynamic_bootstrap_starts_without_control_plane(tmp_path: Path) -> None:
    config = render_bootstrap(xds_host="127.0.0.1", xds_port=free_port(), admin_port=free_port())
    with EnvoyProcess() as envoy:
        envoy.start(config, tmp_path / "envoy.log")
        envoy.wait_admin(timeout=10)
        assert envoy.stat("control_plane.connected_state") == 0
        assert "xds_cluster" in {c["name"] for c in envoy.clusters_json()["cluster_statuses"]}
        pid = envoy.pid
    assert pid is not None and _gone(pid)


@pytest.mark.slow
def test_fleet_echo_and_counters() -> None:
    with BackendFleet(2) as fleet:
        url = f"http://{fleet.addresses[1]}/v1/completions?x=1"
        status, raw = _get(url, data=json.dumps({"model": "m1"}).encode())
        assert status == 200
        assert json.loads(raw) == {"backend": fleet.addresses[1], "method": "POST",
                                   "path": "/v1/completions?x=1", "model": "m1"}  # fmt: skip
        _get(f"http://{fleet.addresses[1]}/anything")
        assert fleet.request_counts() == {fleet.addresses[0]: 0, fleet.addresses[1]: 2}


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    assert 'gpu="0"' in line and 'UUID="GPU-' in line
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.slow
def test_fleet_metrics_are_mutable_and_can_fail() -> None:
    with BackendFleet(1) as fleet:
        url = f"http://{fleet.addresses[0]}/metrics"
        fleet.set_memory(0, used_mib=30000, total_mib=80000)
        _, text = _get(url)
        assert (_metric(text, "DCGM_FI_DEV_FB_USED"), _metric(text, "DCGM_FI_DEV_FB_FREE")) == (
            30000,
            50000,
        )
        fleet.set_metrics_mode(0, "garbage")
        assert "DCGM_FI_DEV_FB_FREE{" not in _get(url)[1]
        fleet.set_metrics_mode(0, "error")
        with pytest.raises(urllib.error.HTTPError):
            _get(url)
        fleet.set_metrics_mode(0, "hang")
        with pytest.raises(TimeoutError):
            _get(url, timeout=0.3)
        fleet.set_metrics_mode(0, "ok")
        assert _metric(_get(url)[1], "DCGM_FI_DEV_FB_USED") == 30000
        assert fleet.scrape_count(0) == 5 and fleet.request_count(0) == 0


def test_top_level_bootstrap_validates_and_matches_the_local_example() -> None:
    root = ROOT
    bootstrap = root / "envoy-bootstrap.yaml"
    config = yaml.safe_load(bootstrap.read_text())
    xds_port = int(yaml.safe_load((root / "examples" / "local.yaml").read_text())
                   ["xds"]["address"].rsplit(":", 1)[1])
    assert config == render_bootstrap(xds_host="127.0.0.1", xds_port=xds_port, admin_port=9901)
    cmd = [envoy_binary(), "--mode", "validate", "--disable-hot-restart", "-c", str(bootstrap)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    import socket

    from trimtab_dev.envoy_process import _ephemeral_range, free_port
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert not [p for p in ports if low <= p <= high]
    # a server binding port 0 (as the test backends do) is never handed one of them
    held = []
    for _ in range(200):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        held.append(sock)
    try:
        assert not {s.getsockname()[1] for s in held} & set(ports)
    finally:
        for sock in held:
            sock.close()
