"""The `trimtab` command line: version, validate (exit 2 naming key path and reason), serve,
rollout (against a real admin server with a bearer token) and the JSON log format."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from tests.support.wait import wait_until
from trimtab_dev.envoy_process import free_port
from xds_server import __version__
from xds_server.cli import EXIT_BAD_INPUT, main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "local.yaml"

POOL = """\
pools:
  - name: llama
    model: meta/llama
    endpoints:
      - address: 127.0.0.1:8001
"""


CANARY = """\
pools:
  - name: qwen
    model: qwen/qwen
    versions:
      stable: {endpoints: [{address: 127.0.0.1:8001, signals: {gpu_mem_pct: 10}}]}
      canary: {endpoints: [{address: 127.0.0.1:8002, signals: {gpu_mem_pct: 10}}]}
    rollout: {start_percent: 10}
"""
SCRAPE_ONLY = "a canary rollout (`versions`) needs telemetry source `scrape`"


def _cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "xds_server.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> tuple[int, str]:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    code = main(["validate", "--config", str(path)])
    return code, capsys.readouterr().err


def _problem_lines(stderr: str) -> list[str]:
    """The lines after the 'invalid config' header: one per problem."""
    lines = stderr.strip().splitlines()
    assert lines and lines[0].startswith("trimtab: invalid config"), stderr
    return lines[1:]


def test_version_subprocess() -> None:
    result = _cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"trimtab {__version__}"


def test_validate_example_subprocess() -> None:
    result = _cli("validate", "--config", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert "ok (1 pools, 3 endpoints)" in result.stdout


def test_validate_bad_address_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(POOL.replace("127.0.0.1:8001", "foo"))
    result = _cli("validate", "--config", str(path))
    assert result.returncode == EXIT_BAD_INPUT
    assert _problem_lines(result.stderr) == [
        "pools[llama].endpoints[0].address: expected host:port, got 'foo'"]


def test_serve_with_bad_config_exits_2_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("xds: {address: 127.0.0.1:18000}\n")
    result = _cli("serve", "--config", str(path), timeout=15.0)
    assert result.returncode == EXIT_BAD_INPUT
    assert "pools: Field required" in _problem_lines(result.stderr)


def test_validate_ok_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(POOL)
    assert main(["validate", "--config", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: ok (1 pools, 1 endpoints)"


CASES = {
    "missing-pools": ("xds: {address: 127.0.0.1:18000}\n", "pools", "Field required"),
    "missing-model": (POOL.replace("    model: meta/llama\n", ""), "pools[llama].model",
                      "Field required"),
    "bad-address": (POOL.replace("127.0.0.1:8001", "foo"), "pools[llama].endpoints[0].address",
                    "expected host:port, got 'foo'"),
    "duplicate-pool": (POOL + POOL[len("pools:\n"):].replace("meta/llama", "meta/other"),
                       "pools[1].name", "duplicate pool name 'llama'"),
    "duplicate-endpoint": (POOL + "      - address: 127.0.0.1:8001\n",
                           "pools[llama].endpoints[1].address",
                           "duplicate endpoint address '127.0.0.1:8001'"),
    "interval-zero": ("telemetry: {interval_seconds: 0}\n" + POOL,
                      "telemetry.interval_seconds", "greater than 0"),
    "interval-negative": ("telemetry: {interval_seconds: -2}\n" + POOL,
                          "telemetry.interval_seconds", "greater than 0"),
    "unknown-lb-policy": (POOL.replace("    model: meta/llama\n",
                                       "    model: meta/llama\n    lb_policy: weighted\n"),
                          "pools[llama].lb_policy", "got 'weighted'"),
    "unknown-key": ("colour: blue\n" + POOL, "colour", "unknown key"),
    "unknown-nested-key": (POOL.replace("    model: meta/llama\n",
                                        "    model: meta/llama\n    weight: 3\n"),
                           "pools[llama].weight", "unknown key"),
    "bad-hostname-endpoint": (POOL.replace("127.0.0.1:8001", "vllm_1.svc:8001"),
                              "pools[llama].endpoints[0].address",
                              "expected an IP address or a DNS host name, got 'vllm_1.svc': "
                              "label 'vllm_1' is not 1..63 letters, digits and inner hyphens"),
    "hostname-listener": ("listener: {address: 'localhost:10000'}\n" + POOL, "listener.address",
                          "expected an IP address (Envoy binds a listener to a socket address, "
                          "not a hostname), got 'localhost'"),
    "canary-static-source": (CANARY.replace("    rollout:", "    telemetry_source: static\n"
                                                            "    rollout:"),
                             "pools[qwen].telemetry_source", f"{SCRAPE_ONLY}: its SLO gates read "
                             "latency histograms and request counters from the endpoints' "
                             "metrics pages; this pool reads 'static'"),
    "canary-prometheus-source": ("telemetry: {source: prometheus}\n" + CANARY,
                                 "pools[qwen].telemetry_source",
                                 "this pool reads 'prometheus' (from telemetry.source)"),
    "canary-file-source": ("telemetry: {source: file, file: signals.yaml}\n" + CANARY,
                           "pools[qwen].telemetry_source", SCRAPE_ONLY),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_validate_names_key_path_and_reason(case: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    text, key_path, reason = CASES[case]
    code, stderr = _validate(tmp_path, capsys, text)
    assert code == EXIT_BAD_INPUT
    matching = [line for line in _problem_lines(stderr) if line.startswith(f"{key_path}: ")]
    assert matching, stderr
    assert reason in matching[0], stderr


def test_unknown_lb_policy_lists_the_choices(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = POOL.replace("    model: meta/llama\n", "    model: meta/llama\n    lb_policy: x\n")
    _, stderr = _validate(tmp_path, capsys, text)
    assert "'round_robin'" in stderr and "'least_request'" in stderr


def test_every_problem_gets_its_own_line(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    text = "telemetry: {interval_seconds: 0}\n" + POOL.replace("127.0.0.1:8001", "foo")
    code, stderr = _validate(tmp_path, capsys, text)
    assert code == EXIT_BAD_INPUT
    keys = sorted(line.split(": ", 1)[0] for line in _problem_lines(stderr))
    assert keys == ["pools[llama].endpoints[0].address", "telemetry.interval_seconds"]


def test_invalid_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = _validate(tmp_path, capsys, "pools: [\n  - name: a\n    model: {\n")
    assert code == EXIT_BAD_INPUT
    (line,) = _problem_lines(stderr)
    assert "invalid YAML at line" in line and "column" in line


def test_top_level_not_a_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = _validate(tmp_path, capsys, "- just\n- a list\n")
    assert code == EXIT_BAD_INPUT
    assert _problem_lines(stderr) == ["expected a mapping at the top level, got list"]


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    code = main(["validate", "--config", str(missing)])
    assert code == EXIT_BAD_INPUT
    (line,) = _problem_lines(capsys.readouterr().err)
    assert line.startswith(f"cannot read config file '{missing}'")


def test_serve_with_bad_config_in_process(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(POOL.replace("127.0.0.1:8001", "foo"))
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_INPUT
    assert "pools[llama].endpoints[0].address: expected host:port, got 'foo'" in capsys.readouterr().err


def test_missing_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == EXIT_BAD_INPUT
    assert "usage: trimtab" in capsys.readouterr().err


def test_hostname_listener_is_one_problem_and_an_ip_passes(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, stderr = _validate(tmp_path, capsys, "listener: {address: 'envoy.local:80'}\n" + POOL)
    assert code == EXIT_BAD_INPUT
    assert _problem_lines(stderr) == [
        "listener.address: expected an IP address (Envoy binds a listener to a socket address, "
        "not a hostname), got 'envoy.local'"]
    for address in ("127.0.0.1:10000", "'[::1]:10000'", "0.0.0.0:10000"):
        code, stderr = _validate(tmp_path, capsys, f"listener: {{address: {address}}}\n" + POOL)
        assert code == 0, (address, stderr)


def test_canary_with_the_scrape_source_passes(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Scrape (the default) is fine, and other sources stay fine for pools without versions."""
    other = POOL[len("pools:\n"):].replace("    model: meta/llama\n",
                                           "    model: meta/llama\n    telemetry_source: file\n")
    text = "telemetry: {file: signals.yaml}\n" + CANARY + other
    assert _validate(tmp_path, capsys, text) == (0, "")


def test_serve_refuses_a_corrupt_rollout_state_file(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("rollouts: {state_file: state.json}\n" + CANARY)
    state = {"pool": "qwen", "phase": "progressing", "percent": "15", "step": 1,
             "step_started_at": 0.0}
    (tmp_path / "state.json").write_text(json.dumps({"version": 1, "rollouts": {"qwen": state}}))
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "refusing to start" in err and "state.json" in err
    assert "rollouts.qwen.percent: expected a finite number in 0..100, got '15'" in err


def test_serve_with_a_missing_admin_token_file_exits_2(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    missing = tmp_path / "no-such-token"
    from trimtab_dev.envoy_process import free_port
    path.write_text(f"xds: {{address: '127.0.0.1:{free_port()}'}}\n"
                    f"admin: {{address: '127.0.0.1:{free_port()}', "
                    f"auth: {{token_file: '{missing}'}}}}\n" + POOL)
    assert main(["serve", "--config", str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "cannot start" in err and str(missing) in err and "cannot be read" in err


# -- `trimtab rollout` against a real admin server with a bearer token ---------------------------

TOKEN = "s3cret-admin-token"


def _get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.fixture
def guarded_server(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """`trimtab serve` whose admin API wants a bearer token for reads and writes; yields
    (config path, admin base URL)."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    admin = free_port()
    config = yaml.safe_load(CANARY)
    for version in config["pools"][0]["versions"].values():
        version["endpoints"] = [{"address": f"127.0.0.1:{free_port()}"}]  # nothing listens
    config.update({"xds": {"address": f"127.0.0.1:{free_port()}"},
                   "listener": {"address": f"127.0.0.1:{free_port()}"},
                   "admin": {"address": f"127.0.0.1:{admin}",
                             "auth": {"token_file": str(tmp_path / "token"),
                                      "protect_reads": True}},
                   "rollouts": {"state_file": str(tmp_path / "rollouts.json")}})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "xds_server.cli", "--log-level", "warning",
                             "serve", "--config", str(path)], cwd=ROOT)
    base = f"http://127.0.0.1:{admin}"
    try:
        def readyz() -> int:  # ready: the first tick started the rollout
            assert proc.poll() is None, "trimtab serve exited"
            return _get_status(f"{base}/readyz")

        wait_until(readyz, 30, "trimtab serve to become ready", check=lambda s: s == 200,
                   every=0.05)
        yield path, base
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_rollout_commands_send_the_admin_token(guarded_server: tuple[Path, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path, base = guarded_server
    assert _get_status(f"{base}/v1/rollouts") == 401  # the token really is required
    assert main(["rollout", "pause", "qwen", "--config", str(path)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert (answer["phase"], answer["percent"]) == ("paused", 10.0)
    assert main(["rollout", "status", "--json", "--config", str(path)]) == 0  # reads too
    assert json.loads(capsys.readouterr().out)["rollouts"]["qwen"]["phase"] == "paused"
    assert main(["rollout", "status", "qwen", "--config", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["pool", "phase", "canary", "step", "step", "age", "reason"]
    assert table[1].split()[:3] == ["qwen", "paused", "10%"]
    assert any(line.split()[2:4] == ["pause", "10%"] for line in table)  # its latest events
    assert main(["rollout", "resume", "qwen", "--config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["phase"] == "progressing"


def test_rollout_without_the_token_is_refused_with_a_hint(guarded_server: tuple[Path, str],
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    path, base = guarded_server
    assert main(["rollout", "abort", "qwen", "--admin", base]) == 1
    err = capsys.readouterr().err
    assert "401" in err and "pass --config with the admin.auth" in err
    assert main(["rollout", "status", "--json", "--config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["rollouts"]["qwen"]["phase"] == "progressing"


def test_rollout_with_an_unreadable_token_file_exits_2(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    missing = tmp_path / "no-token"
    path.write_text(f"admin: {{auth: {{token_file: '{missing}'}}}}\n" + POOL)
    assert main(["rollout", "status", "--config", str(path)]) == EXIT_BAD_INPUT
    assert f"admin.auth.token_file: admin token file '{missing}' cannot be read" in \
        capsys.readouterr().err


NOW = 1_700_000_600.0
ROLLOUTS = {
    "rollouts": {
        "qwen": {"phase": "paused", "percent": 10.0, "step": 1, "step_started_at": NOW - 42,
                 "reason": "paused by operator",
                 "history": [{"at": NOW - 100, "kind": "start", "percent": 10.0, "reason": ""},
                             {"at": NOW - 42, "kind": "pause", "percent": 10.0,
                              "reason": "paused by operator"}]},
        "llama": {"phase": "progressing", "percent": 30.0, "step": 3,
                  "step_started_at": NOW - 5, "reason": "", "history": []},
    },
    "leader": {"mode": "embedded", "leading": True},
}


def test_rollout_status_table_shows_every_pool_or_only_the_one_named() -> None:
    from xds_server.cli import render_rollouts

    every = render_rollouts(ROLLOUTS, now=NOW).splitlines()
    assert [line.split()[:3] for line in every[1:3]] == [["llama", "progressing", "30%"],
                                                         ["qwen", "paused", "10%"]]
    one = render_rollouts(ROLLOUTS, "qwen", now=NOW).splitlines()
    assert one[0].split() == ["pool", "phase", "canary", "step", "step", "age", "reason"]
    assert one[1].split() == ["qwen", "paused", "10%", "1", "42s", "paused", "by", "operator"]
    assert not any("llama" in line for line in one)
    assert "latest events of qwen (oldest first):" in one
    events = [line.split() for line in one if line.startswith("2023-")]
    assert [e[2:4] for e in events] == [["start", "10%"], ["pause", "10%"]]
    assert one[-1] == "this replica steps rollouts: yes (mode embedded)"
    with pytest.raises(KeyError):
        render_rollouts(ROLLOUTS, "nope", now=NOW)


@pytest.fixture
def rollouts_api() -> Iterator[str]:
    """A stand-in admin API whose GET /v1/rollouts answers ROLLOUTS; yields its base URL."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps(ROLLOUTS).encode()
            self.send_response(200 if self.path == "/v1/rollouts" else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_rollout_status_pool_prints_that_pool_as_a_table(rollouts_api: str,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    assert main(["rollout", "status", "llama", "--admin", rollouts_api]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:4] == ["llama", "progressing", "30%", "3"]
    assert "qwen" not in out and "{" not in out  # that pool only, and not JSON
    assert main(["rollout", "status", "--admin", rollouts_api]) == 0
    assert "qwen" in capsys.readouterr().out
    assert main(["rollout", "status", "llama", "--json", "--admin", rollouts_api]) == 0
    assert set(json.loads(capsys.readouterr().out)["rollouts"]) == {"llama"}
    assert main(["rollout", "status", "nope", "--admin", rollouts_api]) == EXIT_BAD_INPUT
    assert "no rollout for pool 'nope' (pools with a rollout: llama, qwen)" in \
        capsys.readouterr().err


# -- logging ------------------------------------------------------------------------------------


def test_json_log_format_writes_one_object_per_line(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(POOL)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert main(["--log-format", "json", "validate", "--config", str(path)]) == 0
        log = logging.getLogger("trimtab.test")
        log.info("hello %s", "world")
        log.debug("below the level: not written")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("it failed")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert {k: first[k] for k in ("level", "logger", "message")} == {
        "level": "info", "logger": "trimtab.test", "message": "hello world"}
    assert first["time"].endswith("Z")
    when = datetime.fromisoformat(first["time"].replace("Z", "+00:00"))
    assert when.tzinfo is not None and abs((datetime.now(UTC) - when).total_seconds()) < 60
    assert (second["level"], second["message"]) == ("error", "it failed")
    assert "RuntimeError: boom" in second["exc"]


# -- bind errors: one line, exit 2 -------------------------------------------------------------


def _serve_config(tmp_path: Path, **addresses: str) -> Path:
    config = yaml.safe_load(POOL)
    config.update({"xds": {"address": addresses.get("xds", f"127.0.0.1:{free_port()}")},
                   "admin": {"address": addresses.get("admin", f"127.0.0.1:{free_port()}")},
                   "keda": {"address": addresses.get("keda", f"127.0.0.1:{free_port()}")},
                   "rollouts": {"state_file": str(tmp_path / "rollouts.json")}})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o644)
    return path


@pytest.mark.parametrize("which", ["xds", "admin", "keda"])
def test_serve_on_a_port_in_use_exits_2_with_one_line(which: str, tmp_path: Path) -> None:
    """Issue 12 §5: a port in use printed a gRPC (or aiohttp) traceback."""
    import socket

    with socket.socket() as occupier:
        occupier.bind(("127.0.0.1", 0))
        occupier.listen()
        address = f"127.0.0.1:{occupier.getsockname()[1]}"
        result = _cli("serve", "--config", str(_serve_config(tmp_path, **{which: address})),
                      timeout=30.0)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.splitlines() == [f"trimtab: cannot listen on {address}: address in use"]


def test_serve_on_an_address_not_on_this_host_exits_2_with_one_line(tmp_path: Path) -> None:
    address = f"192.0.2.1:{free_port()}"  # TEST-NET-1: never a local address
    result = _cli("serve", "--config", str(_serve_config(tmp_path, admin=address)))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.splitlines() == [
        f"trimtab: cannot listen on {address}: cannot assign address"]


def _nobody_can_run_python() -> bool:
    import os
    import shutil

    return os.geteuid() == 0 and shutil.which("setpriv") is not None


@pytest.mark.skipif(not _nobody_can_run_python(), reason="needs root and setpriv to drop to nobody")
def test_serve_on_a_privileged_port_as_an_unprivileged_user_exits_2(tmp_path: Path) -> None:
    import tempfile

    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*nobody, sys.executable, "-c", "import xds_server.cli"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run this interpreter: {probe.stderr.strip()[-200:]}")
    with tempfile.TemporaryDirectory() as shared:  # readable by nobody, unlike tmp_path
        base = Path(shared)
        base.chmod(0o777)
        address = "127.0.0.1:1009"
        path = _serve_config(base, xds=address)
        result = subprocess.run(
            [*nobody, sys.executable, "-m", "xds_server.cli", "serve", "--config", str(path)],
            capture_output=True, text=True, timeout=30, cwd=ROOT, check=False)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert result.stderr.splitlines() == [
        f"trimtab: cannot listen on {address}: permission denied"]


def test_bind_error_reasons() -> None:
    import errno
    import socket

    from xds_server.listen import CannotListen, cannot_listen, check_bindable, reason_for

    assert reason_for(OSError(errno.EADDRINUSE, "x")) == "address in use"
    assert reason_for(OSError(errno.EACCES, "x")) == "permission denied"
    assert reason_for(OSError(errno.EADDRNOTAVAIL, "x")) == "cannot assign address"
    assert reason_for(OSError(errno.EMFILE, "Too many open files")) == "too many open files"
    with socket.socket() as occupier:
        occupier.bind(("127.0.0.1", 0))
        occupier.listen()
        address = f"127.0.0.1:{occupier.getsockname()[1]}"
        with pytest.raises(CannotListen, match="address in use"):
            check_bindable(address)
        grpc_style = RuntimeError(f"Failed to bind to address {address}; set GRPC_VERBOSITY")
        assert str(cannot_listen(address, grpc_style)) == (
            f"cannot listen on {address}: address in use")
    free = f"127.0.0.1:{free_port()}"
    check_bindable(free)  # nothing there: no error
    check_bindable("127.0.0.1:0")
    assert str(cannot_listen(free, RuntimeError("Failed to bind to address x; set ..."))) == (
        f"cannot listen on {free}: Failed to bind to address x")


# --- hostile files: refused with one line each, exit 2, never a traceback ---------------------

_BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
HOSTILE: dict[str, tuple[bytes, str]] = {
    "not-utf8": (b"pools:\n- name: caf\xe9\n", "not UTF-8: byte 0xe9 at offset 18 (line 2)"),
    "deep-flow": (b"[" * 100_000, "nest"),  # libyaml refuses these itself, at 1000 levels
    "deep-block": ("".join("  " * i + "a:\n" for i in range(100)).encode(),
                   "nested deeper than 64 levels at line 65"),
    "alias-bomb": (_BOMB.encode(), "YAML nodes once aliases are expanded"),
    "recursive-alias": (b"pools: &p [*p]\n", "recursive YAML alias"),
    "alias-depth": ("".join(f"a{i}: &a{i} [{'*a' + str(i - 1) if i else 1}]\n"
                            for i in range(100)).encode(), "aliases nest deeper than 64"),
    "huge-int": (b"pools: " + b"9" * 5000 + b"\n", "unusable YAML value"),
    "oversized": (b"#" * (4 * 1024 * 1024 + 1), "larger than 4194304 bytes"),
    "nul-byte": (b"pools: [\x00]\n", "invalid YAML"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_validate_refuses_a_hostile_file_with_one_line(case: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    raw, reason = HOSTILE[case]
    path = tmp_path / "config.yaml"
    path.write_bytes(raw)
    assert main(["validate", "--config", str(path)]) == EXIT_BAD_INPUT
    lines = _problem_lines(capsys.readouterr().err)
    assert len(lines) == 1 and reason in lines[0], lines
    assert "Traceback" not in lines[0]


def test_validate_a_non_utf8_file_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(b"pools:\n- name: caf\xe9\n")
    result = _cli("validate", "--config", str(path))
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "Traceback" not in result.stderr and "not UTF-8" in result.stderr


def test_ordinary_anchors_and_aliases_still_load(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    text = ("pools:\n- name: a\n  model: m\n  endpoints: &eps [{address: 127.0.0.1:8001}]\n"
            "- name: b\n  model: n\n  endpoints: *eps\n")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert main(["validate", "--config", str(path)]) == 0, capsys.readouterr().err


def _ticks(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
            return int(json.loads(response.read())["ticks"])
    except urllib.error.HTTPError as exc:
        return int(json.loads(exc.read())["ticks"])


def test_sighup_refuses_a_broken_file_then_applies_a_new_interval(tmp_path: Path) -> None:
    admin = free_port()

    def config(interval: float, xds_port: int) -> dict:
        return {"xds": {"address": f"127.0.0.1:{xds_port}"},
                "admin": {"address": f"127.0.0.1:{admin}"},
                "listener": {"address": f"127.0.0.1:{free_port()}"},
                "telemetry": {"interval_seconds": interval, "source": "static"},
                "pools": [{"name": "p", "model": "m", "endpoints": [
                    {"address": "127.0.0.1:8001", "signals": {"gpu_mem_pct": 10}}]}]}

    xds = free_port()
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(30.0, xds)))
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "xds_server.cli", "serve", "--config",
                             str(path)], cwd=ROOT, stderr=log)
    base = f"http://127.0.0.1:{admin}"

    def wait(what: str, check) -> None:
        def alive_and_checked() -> bool:
            assert proc.poll() is None, "trimtab serve exited"
            return bool(check())

        wait_until(alive_and_checked, 20, what, every=0.05)

    def logged() -> str:
        return (tmp_path / "stderr").read_text()

    try:
        wait("the first tick", lambda: _get_status(f"{base}/readyz") == 200)
        path.write_bytes(b"pools:\n- name: caf\xe9\n")
        proc.send_signal(signal.SIGHUP)
        wait("reload refused", lambda: "reload refused:" in logged())
        path.write_text(yaml.safe_dump(config(1.0, free_port())))  # a new xds address
        proc.send_signal(signal.SIGHUP)
        wait("xds.address refused", lambda: "reload refused: xds.address" in logged())
        before = _ticks(base)
        path.write_text(yaml.safe_dump(config(0.1, xds)))
        proc.send_signal(signal.SIGHUP)
        wait("ticks at the new interval", lambda: _ticks(base) >= before + 5)
        assert "not UTF-8" in logged()
        assert "Task exception was never retrieved" not in logged()
        assert "Traceback" not in logged()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        log.close()


# --- issue 26 §6: one port per listener; a FIFO in the config's place --------------------------


def test_validate_refuses_xds_admin_and_keda_on_one_port(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """serve would bind the first and exit 2 on the second; validate says so first."""
    shared = "xds: {address: '0.0.0.0:18000'}\nadmin: {address: '127.0.0.1:18000'}\n" \
             "keda: {address: '127.0.0.1:18000'}\n"
    code, stderr = _validate(tmp_path, capsys, shared + POOL)
    assert code == EXIT_BAD_INPUT
    assert _problem_lines(stderr) == [
        "admin.address: 127.0.0.1:18000 and xds.address (0.0.0.0:18000) both listen on port "
        "18000; give each listener its own port",
        "keda.address: 127.0.0.1:18000 and xds.address (0.0.0.0:18000) both listen on port "
        "18000; give each listener its own port",
        "keda.address: 127.0.0.1:18000 and admin.address (127.0.0.1:18000) both listen on port "
        "18000; give each listener its own port"]


def _reload_config(interval: float) -> dict:
    return {"telemetry": {"interval_seconds": interval, "source": "static"},
            "pools": [{"name": "p", "model": "m", "endpoints": [
                {"address": "127.0.0.1:8001", "signals": {"gpu_mem_pct": 10}}]}]}


def test_reload_refuses_a_fifo_at_once_and_keeps_the_old_config(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO in the config's place blocked the whole loop until someone wrote it."""
    import asyncio
    import os
    import threading

    from xds_server.app import Trimtab
    from xds_server.config.load import parse_config

    path = tmp_path / "trimtab.yaml"
    trimtab = Trimtab(parse_config(_reload_config(2.0)), path)
    os.mkfifo(path)
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(trimtab.reload())),
                              daemon=True)
    try:
        with caplog.at_level(logging.ERROR, logger="trimtab"):
            thread.start()
            thread.join(3.0)
            blocked = thread.is_alive()
    finally:  # old code blocks in open(): give it a writer with the same config, then EOF
        if thread.is_alive():
            with open(path, "w") as writer:
                writer.write(yaml.safe_dump(_reload_config(2.0)))
            thread.join(10.0)
    assert not blocked, "reload blocked on a FIFO"
    assert outcome == [False]
    refused = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
    assert refused == [f"reload refused: {path}: is a FIFO (named pipe); a config must be a "
                       f"regular file, refused without reading it; keeping the last good "
                       f"config"], refused
    assert trimtab.config.telemetry.interval_seconds == 2.0
    os.unlink(path)
    path.write_text(yaml.safe_dump(_reload_config(1.0)))
    assert asyncio.run(trimtab.reload()) is True  # a regular file again: applied
    assert trimtab.config.telemetry.interval_seconds == 1.0
