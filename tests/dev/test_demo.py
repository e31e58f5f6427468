"""`python -m trimtab_dev.demo.local`: the documented layout, port overrides, and a short real run."""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.paths import ROOT
from trimtab_dev.demo.layout import prepare_layout
from trimtab_dev.demo.local import DEFAULT_CONFIG, build_parser
from trimtab_dev.envoy_process import free_port

ROW = re.compile(r"^\s*\d+\.\ds((?: \|\s+\d+\.\d%\s+\d+\*?\s+\d+\s+\d+%){3})\s+\(\d+ req\)$")
SUMMARY = re.compile(r"^\s+(127\.0\.0\.1:\d+)\s+observed\s+(\d+)%\s+weights\s+(\d+)%$")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _demo(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trimtab_dev.demo.local", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)


def test_default_layout_uses_the_documented_files(tmp_path: Path) -> None:
    layout = prepare_layout(_args(), tmp_path)
    assert layout.config_path == DEFAULT_CONFIG  # examples/local-fake-gpus.yaml
    assert (layout.backends, layout.xds, layout.admin, layout.listener, layout.envoy_admin) == (
        [8001, 8002, 8003], 18000, 19100, 10000, 9901)
    assert list(tmp_path.iterdir()) == []


def test_port_overrides_patch_copies_of_the_files(tmp_path: Path) -> None:
    args = _args("--backend-ports", "7001,7002,7003", "--xds-port", "7100", "--admin-port",
                 "7101", "--listener-port", "7102", "--envoy-admin-port", "7103")
    layout = prepare_layout(args, tmp_path)
    assert layout.config_path == tmp_path / "trimtab.yaml"
    config = yaml.safe_load(layout.config_path.read_text())
    endpoints = config["pools"][0]["endpoints"]
    assert [e["address"] for e in endpoints] == ["127.0.0.1:7001", "127.0.0.1:7002",
                                                 "127.0.0.1:7003"]
    assert endpoints[0]["metrics_url"] == "http://127.0.0.1:7001/metrics"
    assert (config["xds"]["address"], config["admin"]["address"],
            config["listener"]["address"]) == ("127.0.0.1:7100", "127.0.0.1:7101", "0.0.0.0:7102")
    bootstrap = layout.bootstrap
    assert bootstrap["admin"]["address"]["socket_address"]["port_value"] == 7103
    xds = bootstrap["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]
    assert xds["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"] == 7100
    assert "address: 127.0.0.1:8001" in DEFAULT_CONFIG.read_text()  # the original is untouched


def test_busy_port_fails_fast_naming_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = [str(free_port()) for _ in range(3)]
        result = _demo("--duration", "5", "--backend-ports", ",".join(ports), "--xds-port",
                       str(port), "--admin-port", str(free_port()), "--listener-port",
                       str(free_port()), "--envoy-admin-port", str(free_port()), timeout=20)
    assert result.returncode == 1
    assert f"port {port} (trimtab xDS, 127.0.0.1:{port}) is busy" in result.stderr
    assert "starting" not in result.stdout  # nothing was started


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_short_demo_run_prints_weights_and_split_and_cleans_up() -> None:
    backends = [free_port() for _ in range(3)]
    others = {name: free_port() for name in ("xds", "admin", "listener", "envoy-admin")}
    argv = ["--duration", "8", "--backend-ports", ",".join(map(str, backends))]
    for name, port in others.items():
        argv += [f"--{name}-port", str(port)]
    result = _demo(*argv, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len([line for line in lines if ROW.match(line)]) >= 3, result.stdout
    summary = [m.groups() for line in lines if (m := SUMMARY.match(line))]
    assert [address for address, _, _ in summary] == [f"127.0.0.1:{p}" for p in backends]
    for address, observed, expected in summary:
        assert abs(int(observed) - int(expected)) <= 10, (address, result.stdout)
    workdir = re.search(r"log: (\S+)/trimtab\.log", result.stdout)
    assert workdir is not None and _processes_mentioning(workdir.group(1)) == []
    assert not any(_listening(port) for port in [*backends, *others.values()])


def test_live_table_expects_the_status_pages_shares_not_host_weights_alone() -> None:
    """Issue 25 item 3: with capacity tiers the host weights are equal (100) and the tier's
    locality weight carries the split; the demo table's `expected` column is the status
    page's share (weight_calculator.localities.document_shares), and shows the tier."""
    from types import SimpleNamespace

    from trimtab_dev.demo.live import COLUMNS, RunView
    from weight_calculator.localities import document_shares

    servers = [SimpleNamespace(name=n, gpu=g, address=a) for n, g, a in (
        ("a100-0", "A100", "10.0.0.1:80"), ("a100-1", "A100", "10.0.0.2:80"),
        ("l4-0", "L4", "10.0.0.3:80"))]
    weights = {"10.0.0.1:80": {"weight": 100, "health": "HEALTHY", "locality": "kv400000",
                               "locality_weight": 100},
               "10.0.0.2:80": {"weight": 100, "health": "HEALTHY", "locality": "kv400000",
                               "locality_weight": 100},
               "10.0.0.3:80": {"weight": 100, "health": "HEALTHY", "locality": "kv100000",
                               "locality_weight": 10}}
    sample = lambda value: SimpleNamespace(samples=[(0.0, value)])  # noqa: E731
    view = RunView("trimtab", SimpleNamespace(servers=servers), None, {  # type: ignore[arg-type]
        "trimtab_weights": sample(weights), "sim": sample({"servers": {}}),
        "envoy_requests": sample({"10.0.0.1:80": 48, "10.0.0.2:80": 47, "10.0.0.3:80": 5})})
    rows = {r.name: r for r in view.rows()}
    assert {n: r.expected for n, r in rows.items()} == {
        s.name: document_shares(weights)[s.address] for s in servers}
    assert rows["l4-0"].expected == pytest.approx(10 / 110)  # not a third: its tier weighs 10
    cells = dict(zip(COLUMNS, rows["l4-0"].cells(), strict=True))
    assert cells["weight"] == "100 × kv100000 10" and cells["expected"] == "9.1%"
    assert cells["share"] == "5.0% (5)"
