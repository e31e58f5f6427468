"""`trimtab bench`: the report's arithmetic (fast) and a tiny real run of every policy (slow).

The slow test runs the whole benchmark (simulated fleet, a real Envoy per policy, trimtab for
the ``trimtab`` policy) with durations of a few seconds. It checks the *shape* of what the
benchmark produces: a table row and a JSON entry per policy with measured requests, the
comparison against ``least_request`` and the PNG. The timing targets live in the benchmark's
own output, never in assertions here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from xds_server.bench import POLICIES, report
from xds_server.bench.cli import main as bench_main


def _summary(ttft_p99: float, tokens: float, errors: int = 0) -> dict[str, Any]:
    pct = {"p50": ttft_p99 / 4, "p90": ttft_p99 / 2, "p99": ttft_p99}
    return {"summary": {"ttft_s": pct, "tpot_s": pct, "e2e_s": pct,
                        "window_throughput": {"req_per_s": 1.0, "output_tokens_per_s": tokens},
                        "throughput": {"output_tokens_per_s": tokens},
                        "errors": {"count": errors}}}


def test_comparison_ratios_are_against_least_request() -> None:
    entries = {"least_request": _summary(2.0, 100.0), "cswrr_orca": _summary(1.0, 100.0),
               "trimtab": _summary(0.2, 110.0, errors=1)}
    doc = report.comparison(entries)
    assert doc["ratios"]["trimtab"]["ttft_p99_vs_least_request"] == pytest.approx(0.1)
    assert doc["ratios"]["least_request"]["ttft_p99_vs_least_request"] == pytest.approx(1.0)
    verdicts = {t["name"]: t["met"] for t in doc["targets"]}
    assert verdicts == {"ttft_p99_vs_least_request": True, "ttft_p99_vs_cswrr_orca": True,
                        "tokens_vs_least_request": True, "tokens_vs_cswrr_orca": True,
                        "no_failures": False}


def test_targets_are_unknown_when_a_policy_did_not_run() -> None:
    doc = report.comparison({"trimtab": _summary(0.2, 110.0)})
    assert [t["met"] for t in doc["targets"] if t["name"] != "no_failures"] == [None] * 4


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--out", str(tmp_path)]) == 2
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("servers: nope\n")
    workload = tmp_path / "w.yaml"
    workload.write_text("rate: 1\n")
    code = bench_main(["--fleet", str(fleet), "--workload", str(workload), "--out",
                       str(tmp_path / "out")])
    assert code == 2
    assert "invalid input" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench_main(["--policies", "round_robin,magic", "--out", str(tmp_path)])
    assert exc.value.code == 2


TINY_FLEET = {
    "model": "tiny-model", "model_profile": "llama-3.1-8b", "host": "127.0.0.1", "orca": True,
    "max_model_len": 8192,
    "servers": [{"name": "h100", "gpu": "H100-80G", "count": 1},
                {"name": "l4", "gpu": "L4-24G", "count": 1}],
}
TINY_WORKLOAD = {
    "name": "tiny", "seed": 7, "rate": 4.0, "duration_s": 5, "arrival": {"kind": "poisson"},
    "endpoint": "chat", "stream": True, "models": [{"name": "tiny-model"}],
    "classes": [{"name": "chat", "weight": 1.0,
                 "prompt_tokens": {"dist": "uniform", "min": 50, "max": 200},
                 "max_tokens": {"dist": "uniform", "min": 8, "max": 24}}],
    "timeout_s": 30,
}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_run_produces_a_table_json_and_png_for_every_policy(tmp_path: Path) -> None:
    fleet, workload, out = tmp_path / "fleet.yaml", tmp_path / "workload.yaml", tmp_path / "out"
    fleet.write_text(yaml.safe_dump(TINY_FLEET))
    workload.write_text(yaml.safe_dump(TINY_WORKLOAD))
    cmd = [sys.executable, "-m", "xds_server.cli", "bench", "--fleet", str(fleet),
           "--workload", str(workload), "--duration", "3", "--warmup", "1", "--tail", "10",
           "--interval", "0.5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    for policy in POLICIES:
        assert policy in done.stdout
    doc = json.loads((out / "bench.json").read_text())
    assert list(doc["policies"]) == list(POLICIES)
    for policy, entry in doc["policies"].items():
        summary = entry["summary"]
        assert summary["requests"]["completed"] > 0, policy
        assert summary["ttft_s"]["p99"] is not None and summary["ttft_s"]["p99"] > 0, policy
        assert (out / f"records-{policy}.jsonl").stat().st_size > 0
    assert doc["comparison"]["ratios"]["least_request"]["ttft_p99_vs_least_request"] == 1.0
    weights = doc["policies"]["trimtab"]["trimtab_weights"]
    assert weights, "trimtab's weights were sampled during its run"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fleet() -> Any:
    from xds_server.bench.runner import Fleet, FleetServer
    servers = [FleetServer("h100-0", "H100-80G", "127.0.0.1:1", 453776),
               FleetServer("a100-0", "A100-40G", "127.0.0.1:2", 167184),
               FleetServer("l4-0", "L4-24G", "127.0.0.1:3", 38128)]
    return Fleet("m", servers)


def test_long_context_pool_takes_the_servers_whose_kv_holds_the_longest_requests() -> None:
    from xds_server.bench.cli import long_context_for
    from xds_server.loadgen.workload import load_workload
    w = load_workload("examples/workload-mixed.yaml")  # longest request: 32000 + 512 tokens
    assert long_context_for(_fleet(), w, 0) is None
    eight = long_context_for(_fleet(), w, 8192)
    assert eight is not None and eight.addresses == ("127.0.0.1:1",)
    assert eight.min_prompt_bytes == 4 * 8192
    four = long_context_for(_fleet(), w, 8192, 4)
    assert four is not None and four.addresses == ("127.0.0.1:1", "127.0.0.1:2")


def test_trimtab_config_with_a_long_context_class_validates() -> None:
    from xds_server.bench.envoy_configs import LongContext, trimtab_config
    from xds_server.config import parse_config
    doc = trimtab_config(model="m", addresses=["127.0.0.1:1", "127.0.0.1:2"], xds_port=1,
                         admin_port=2, listener_port=3,
                         long_context=LongContext(32768, ("127.0.0.1:1",)))
    config = parse_config(doc)
    main, long_pool = config.pools
    assert main.long_context is not None and main.long_context.pool == long_pool.name
    assert [e.address for e in long_pool.endpoints] == ["127.0.0.1:1"]
