"""`trimtab bench tiers` (trimtab_dev/bench/tiers.py): reached through `trimtab bench`, bad
arguments exit 2, and a tiny real run (simulated text, VL and long-generation servers, a real
Envoy, trimtab serve) writes its JSON with image requests only on the VL server when tiered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trimtab_dev.bench.cli import main as bench_main

ROOT = Path(__file__).resolve().parents[2]


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["tiers", "--seeds", "x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert bench_main(["tiers", "--rate", "0"]) == 2


def test_trimtab_bench_tiers_is_a_scenario_of_trimtab_bench() -> None:
    done = subprocess.run([sys.executable, "-m", "xds_server.cli", "bench", "tiers", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: trimtab bench tiers")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_run_sends_images_only_to_the_vl_pool_when_tiered(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    done = subprocess.run([sys.executable, "-m", "xds_server.cli", "bench", "tiers",
                           "--duration", "4", "--rate", "6", "--seeds", "1",
                           "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["runs"]["1"]
    assert set(runs) == {"tiers", "one-pool"}
    tiered = runs["tiers"]
    assert all(entry["errors"] == 0 for entry in tiered.values()), tiered
    assert tiered["image"]["servers"] and all(s.startswith("vl") for s in
                                              tiered["image"]["servers"])
    assert not any(s.startswith("vl") for s in tiered["chat"]["servers"])
    assert "tiers / one-pool" in done.stdout
