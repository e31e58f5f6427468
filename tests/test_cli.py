"""The `trimtab` command line: version, validate (exit 2 naming key path and reason), serve."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
        "pools[0].endpoints[0].address: expected host:port, got 'foo'"]


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
    "missing-model": (POOL.replace("    model: meta/llama\n", ""), "pools[0].model",
                      "Field required"),
    "bad-address": (POOL.replace("127.0.0.1:8001", "foo"), "pools[0].endpoints[0].address",
                    "expected host:port, got 'foo'"),
    "duplicate-pool": (POOL + POOL[len("pools:\n"):].replace("meta/llama", "meta/other"),
                       "pools[1].name", "duplicate pool name 'llama'"),
    "duplicate-endpoint": (POOL + "      - address: 127.0.0.1:8001\n",
                           "pools[0].endpoints[1].address",
                           "duplicate endpoint address '127.0.0.1:8001'"),
    "interval-zero": ("telemetry: {interval_seconds: 0}\n" + POOL,
                      "telemetry.interval_seconds", "greater than 0"),
    "interval-negative": ("telemetry: {interval_seconds: -2}\n" + POOL,
                          "telemetry.interval_seconds", "greater than 0"),
    "unknown-lb-policy": (POOL.replace("    model: meta/llama\n",
                                       "    model: meta/llama\n    lb_policy: weighted\n"),
                          "pools[0].lb_policy", "got 'weighted'"),
    "unknown-key": ("colour: blue\n" + POOL, "colour", "unknown key"),
    "unknown-nested-key": (POOL.replace("    model: meta/llama\n",
                                        "    model: meta/llama\n    weight: 3\n"),
                           "pools[0].weight", "unknown key"),
    "hostname-endpoint": (POOL.replace("127.0.0.1:8001", "localhost:8001"),
                          "pools[0].endpoints[0].address",
                          "expected an IP address (EDS endpoints are IPs), got 'localhost'"),
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
    assert keys == ["pools[0].endpoints[0].address", "telemetry.interval_seconds"]


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
    assert "pools[0].endpoints[0].address: expected host:port, got 'foo'" in capsys.readouterr().err


def test_missing_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == EXIT_BAD_INPUT
    assert "usage: trimtab" in capsys.readouterr().err
