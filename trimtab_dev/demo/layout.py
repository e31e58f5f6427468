"""The small demo's files and ports: examples/local-fake-gpus.yaml and envoy-bootstrap.yaml as
they are, or patched copies when a port is overridden, and a check that every port is free."""

from __future__ import annotations

import argparse
import copy
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from xds_server.config.addresses import parse_host_port


class DemoError(RuntimeError):
    """The demo cannot run; the message says why."""


@dataclass
class Layout:
    """The files and ports the demo runs with (the documented ones unless overridden)."""

    config: dict[str, Any]
    bootstrap: dict[str, Any]
    config_path: Path  # what trimtab is started with
    backends: list[int]
    xds: int
    admin: int
    listener: int
    envoy_admin: int

    @property
    def pool(self) -> dict[str, Any]:
        return self.config["pools"][0]

    @property
    def interval(self) -> float:
        return float(self.config.get("telemetry", {}).get("interval_seconds", 2.0))

    def fixed_ports(self) -> list[tuple[str, str, int]]:
        """(what, host, port) for every port the demo binds or makes its children bind."""
        listener_host = parse_host_port(self.config["listener"]["address"]).host
        ports = [(f"backend {i + 1}", "127.0.0.1", p) for i, p in enumerate(self.backends)]
        return ports + [("trimtab xDS", "127.0.0.1", self.xds),
                        ("trimtab admin", "127.0.0.1", self.admin),
                        ("Envoy listener", listener_host, self.listener),
                        ("Envoy admin", "127.0.0.1", self.envoy_admin)]


def _port(address: str) -> int:
    return parse_host_port(address).port


def _with_port(address: str, port: int) -> str:
    hp = parse_host_port(address)
    return f"[{hp.host}]:{port}" if ":" in hp.host else f"{hp.host}:{port}"


def _xds_socket(bootstrap: dict[str, Any]) -> dict[str, Any]:
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] == "xds_cluster":
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            return endpoint["address"]["socket_address"]
    raise DemoError("the Envoy bootstrap has no `xds_cluster`")


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DemoError(f"cannot read {path}: {exc}") from None


def _file_layout(config_path: Path, bootstrap_path: Path) -> Layout:
    config, bootstrap = _load_yaml(config_path), _load_yaml(bootstrap_path)
    endpoints = config["pools"][0]["endpoints"]
    layout = Layout(config, bootstrap, config_path, [_port(e["address"]) for e in endpoints],
                    _port(config["xds"]["address"]), _port(config["admin"]["address"]),
                    _port(config["listener"]["address"]),
                    int(bootstrap["admin"]["address"]["socket_address"]["port_value"]))
    if int(_xds_socket(bootstrap)["port_value"]) != layout.xds:
        raise DemoError(f"{bootstrap_path} points Envoy at xDS port "
                        f"{_xds_socket(bootstrap)['port_value']}, {config_path} serves {layout.xds}")
    return layout


def _patch_config(config: dict[str, Any], layout: Layout) -> dict[str, Any]:
    out = copy.deepcopy(config)
    for key in ("xds", "admin", "listener"):
        out[key]["address"] = _with_port(out[key]["address"], getattr(layout, key))
    for endpoint, port in zip(out["pools"][0]["endpoints"], layout.backends, strict=True):
        old = _port(endpoint["address"])
        endpoint["address"] = _with_port(endpoint["address"], port)
        if "metrics_url" in endpoint:
            url = urllib.parse.urlsplit(endpoint["metrics_url"])
            netloc = url.netloc.replace(f":{old}", f":{port}")
            endpoint["metrics_url"] = urllib.parse.urlunsplit(url._replace(netloc=netloc))
    return out


def prepare_layout(args: argparse.Namespace, workdir: Path) -> Layout:
    """The documented files, or patched copies in `workdir` when a port is overridden."""
    layout = _file_layout(Path(args.config), Path(args.bootstrap))
    if len(layout.backends) != 3 or len(layout.config["pools"]) != 1:
        raise DemoError(f"{args.config}: the demo needs one pool with three endpoints")
    wanted = {"backends": args.backend_ports, "xds": args.xds_port, "admin": args.admin_port,
              "listener": args.listener_port, "envoy_admin": args.envoy_admin_port}
    overrides = {k: v for k, v in wanted.items() if v is not None and v != getattr(layout, k)}
    if not overrides:
        return layout
    for key, value in overrides.items():
        setattr(layout, key, value)
    layout.config = _patch_config(layout.config, layout)
    layout.config_path = workdir / "trimtab.yaml"
    layout.config_path.write_text(yaml.safe_dump(layout.config, sort_keys=False))
    layout.bootstrap = copy.deepcopy(layout.bootstrap)
    layout.bootstrap["admin"]["address"]["socket_address"]["port_value"] = layout.envoy_admin
    _xds_socket(layout.bootstrap)["port_value"] = layout.xds
    return layout


def check_ports_free(layout: Layout) -> None:
    for what, host, port in layout.fixed_ports():
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise DemoError(f"port {port} ({what}, {host}:{port}) is busy: {exc.strerror}. "
                                f"Stop whatever uses it, or pick another port (see --help).") from None
