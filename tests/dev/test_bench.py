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

from trimtab_dev.bench import POLICIES, report, spread
from trimtab_dev.bench.cli import main as bench_main


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
    # issue 11's list: P99 <= 0.5 x reference and x cswrr_orca, P50 and tokens/s vs LR
    assert verdicts == {"ttft_p99_vs_reference": None, "ttft_p99_vs_cswrr_orca": True,
                        "ttft_p50_vs_least_request": True, "tokens_vs_least_request": True,
                        "no_failures": False}
    limits = {t["name"]: (t["op"], t["limit"]) for t in doc["targets"]}
    assert limits["ttft_p99_vs_reference"] == ("<=", 0.5)
    assert limits["ttft_p99_vs_cswrr_orca"] == ("<=", 0.5)
    assert "ttft_p99_vs_reference" not in doc["ratios"]["trimtab"]  # reference did not run
    assert doc["target_set"] == "heterogeneous"


def test_ratios_and_targets_against_the_reference_controller() -> None:
    entries = {"least_request": _summary(2.0, 100.0), "reference": _summary(0.5, 100.0),
               "trimtab": _summary(0.4, 99.0)}
    doc = report.comparison(entries)
    assert doc["ratios"]["trimtab"]["ttft_p99_vs_reference"] == pytest.approx(0.8)
    assert doc["ratios"]["reference"]["ttft_p99_vs_least_request"] == pytest.approx(0.25)
    verdicts = {t["name"]: t["met"] for t in doc["targets"]}
    assert verdicts["ttft_p99_vs_reference"] is False  # 0.8 > 0.5
    assert verdicts["tokens_vs_least_request"] is False  # 0.99 < 1
    better = report.comparison({**entries, "trimtab": _summary(0.25, 100.0)})
    assert {t["name"]: t["met"] for t in better["targets"]}["ttft_p99_vs_reference"] is True
    row = next(r for r in report.latency_rows({"comparison": doc}) if r[0] == "trimtab")
    assert row[-2:] == ["0.80x", "0.99x"]


def test_homogeneous_targets_are_no_worse_than_least_request_within_tolerance() -> None:
    def verdicts(ttft: float, tokens: float) -> dict[str, bool | None]:
        entries = {"least_request": _summary(2.0, 100.0), "trimtab": _summary(ttft, tokens)}
        doc = report.comparison(entries, homogeneous=True, tolerance=0.1)
        assert doc["target_set"] == "homogeneous" and doc["tolerance"] == 0.1
        return {t["name"]: t["met"] for t in doc["targets"]}

    assert verdicts(2.18, 91.0) == {"ttft_p99_vs_least_request": True,
                                    "tokens_vs_least_request": True, "no_failures": True}
    assert verdicts(2.3, 100.0)["ttft_p99_vs_least_request"] is False  # 1.15 > 1.1
    assert verdicts(1.0, 89.0)["tokens_vs_least_request"] is False  # 0.89 < 0.9


def test_targets_are_unknown_when_a_policy_did_not_run() -> None:
    doc = report.comparison({"trimtab": _summary(0.2, 110.0)})
    assert [t["met"] for t in doc["targets"] if t["name"] != "no_failures"] == [None] * 4


def test_automatic_classes_are_judged_by_the_quarter_of_cswrr_target() -> None:
    entries = {"least_request": _summary(8.0, 100.0), "cswrr_orca": _summary(4.0, 100.0),
               "trimtab": _summary(1.2, 100.0)}
    plain = {t["name"]: t["met"] for t in report.comparison(entries)["targets"]}
    doc = report.comparison(entries, classes=True)
    with_classes = {t["name"]: (t["limit"], t["met"]) for t in doc["targets"]}
    assert doc["target_set"] == "heterogeneous+auto-classes"
    assert plain["ttft_p99_vs_cswrr_orca"] is True  # 0.3 <= 0.5
    assert with_classes["ttft_p99_vs_cswrr_orca"] == (0.25, False)  # 0.3 > 0.25


def test_fleet_homogeneity_is_detected_from_the_spec() -> None:
    from trimtab_dev.bench.options import fleet_is_homogeneous
    from trimtab_dev.sim.fleet import load_fleet, parse_fleet

    assert not fleet_is_homogeneous(load_fleet("examples/fleet-hetero.yaml"))
    assert fleet_is_homogeneous(load_fleet("examples/fleet-homogeneous.yaml"))
    a100 = {"name": "a", "gpu": "A100-40G", "count": 3}
    dead = {"name": "d", "gpu": "L4-24G", "faults": {"dead": True}}
    slow = {"name": "s", "gpu": "A100-40G", "faults": {"slow": 2.0}}
    assert fleet_is_homogeneous(parse_fleet({"servers": [a100, dead]}))  # never served
    assert not fleet_is_homogeneous(parse_fleet({"servers": [a100, slow]}))
    short = {"name": "m", "gpu": "A100-40G", "max_model_len": 4096}
    assert not fleet_is_homogeneous(parse_fleet({"servers": [a100, short]}))


def test_targets_flag_overrides_detection(tmp_path: Path) -> None:
    from trimtab_dev.bench.options import build_parser, settings_from
    from trimtab_dev.loadgen.workload import load_workload
    from trimtab_dev.sim.fleet import load_fleet

    w = load_workload("examples/workload-mixed.yaml")
    homog = load_fleet("examples/fleet-homogeneous.yaml")

    def settings(*extra: str) -> Any:
        args = build_parser().parse_args(["--out", str(tmp_path), *extra])
        return settings_from(args, w, homog)

    assert settings().homogeneous and settings().tolerance == report.HOMOGENEOUS_TOLERANCE
    assert not settings("--targets", "heterogeneous").homogeneous
    assert settings("--tolerance", "0.2").tolerance == 0.2
    with pytest.raises(SystemExit):
        settings("--tolerance", "1.5")


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
    # the reference controller's weights (capacity x (1 - KV use)) reached Envoy
    ref = doc["policies"]["reference"]["envoy_weights"]
    assert ref["h100"][-1][1] > ref["l4"][-1][1] > 1, ref
    assert doc["config"]["reference"]["weights"] == "reference"
    assert doc["comparison"]["target_set"] == "heterogeneous"
    peaks = [e["sim"]["in_flight_peak"] for e in doc["policies"].values()]
    assert None not in peaks and max(peaks) > 0, peaks
    assert "streams peak" in done.stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fleet() -> Any:
    from trimtab_dev.bench.fleet import Fleet, FleetServer
    servers = [FleetServer("h100-0", "H100-80G", "127.0.0.1:1", 453776),
               FleetServer("a100-0", "A100-40G", "127.0.0.1:2", 167184),
               FleetServer("l4-0", "L4-24G", "127.0.0.1:3", 38128)]
    return Fleet("m", servers)


def test_long_context_pool_takes_the_servers_whose_kv_holds_the_longest_requests() -> None:
    from trimtab_dev.bench.cli import long_context_for
    from trimtab_dev.loadgen.workload import load_workload
    w = load_workload("examples/workload-mixed.yaml")  # longest request: 32000 + 512 tokens
    assert long_context_for(_fleet(), w, 0) is None
    eight = long_context_for(_fleet(), w, 8192)
    assert eight is not None and eight.addresses == ("127.0.0.1:1",)
    assert eight.min_prompt_bytes == 4 * 8192
    four = long_context_for(_fleet(), w, 8192, 4)
    assert four is not None and four.addresses == ("127.0.0.1:1", "127.0.0.1:2")


def test_trimtab_config_with_a_long_context_class_validates() -> None:
    from trimtab_dev.bench.envoy_configs import LongContext, trimtab_config
    from xds_server.config.load import parse_config
    doc = trimtab_config(model="m", addresses=["127.0.0.1:1", "127.0.0.1:2"], xds_port=1,
                         admin_port=2, listener_port=3,
                         long_context=LongContext(32768, ("127.0.0.1:1",)))
    config = parse_config(doc)
    main, long_pool = config.pools
    assert main.long_context is not None and main.long_context.pool == long_pool.name
    assert [e.address for e in long_pool.endpoints] == ["127.0.0.1:1"]


async def _load_until(url: str, done: Any, deadline_s: float, streams: int = 6) -> bool:
    """Closed-loop chat streams through ``url`` until ``done()`` (polled every 0.5 s) or the
    deadline; True when ``done()`` held."""
    import asyncio
    import time

    import aiohttp

    body = {"model": TINY_FLEET["model"], "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 16, "stream": True, "prompt_tokens": 200}

    async def stream_forever(session: aiohttp.ClientSession) -> None:
        while True:
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()

    async with aiohttp.ClientSession() as session:
        senders = [asyncio.create_task(stream_forever(session)) for _ in range(streams)]
        try:
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                await asyncio.sleep(0.5)
                if await asyncio.to_thread(done):
                    return True
            return False
        finally:
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_envoy_cswrr_uses_the_simulators_orca_reports(tmp_path: Path) -> None:
    """An H100 and an L4 behind a static cswrr_orca Envoy: once traffic flows, Envoy's own
    /clusters weights leave 1 (the static default) and differ per host, which happens only
    when Envoy parsed the simulator's ``endpoint-load-metrics`` header."""
    import asyncio

    from trimtab_dev.bench.envoy_configs import CLUSTER, static_bootstrap
    from trimtab_dev.envoy_process import EnvoyProcess, free_port
    from trimtab_dev.sim.fleet import SimFleet

    seen: list[dict[str, int]] = []

    async def scenario() -> bool:
        async with SimFleet(TINY_FLEET) as fleet:
            port = free_port()
            bootstrap = static_bootstrap("cswrr_orca", list(fleet.addresses.values()),
                                         listener_port=port, admin_port=free_port(),
                                         cswrr={"blackout_period": "1s"})
            with EnvoyProcess(log_level="warning") as envoy:
                envoy.start(bootstrap, tmp_path / "envoy.log")
                await asyncio.to_thread(envoy.wait_ready, 20.0)
                assert set(envoy.host_weights(CLUSTER).values()) == {1}

                def weighted() -> bool:
                    seen.append(envoy.host_weights(CLUSTER))
                    return 1 not in seen[-1].values() and len(set(seen[-1].values())) == 2

                return await _load_until(f"http://127.0.0.1:{port}", weighted, 30.0)

    assert asyncio.run(scenario()), f"Envoy's weights never left 1 / never differed: {seen}"


def _doc(ttft: float, tokens: float) -> dict[str, Any]:
    entries = {"least_request": _summary(2.0, 100.0), "reference": _summary(1.0, 100.0),
               "trimtab": _summary(ttft, tokens)}
    return {"comparison": report.comparison(entries)}


def test_spread_gives_min_median_max_of_every_ratio_across_seeds() -> None:
    docs = {42: _doc(0.2, 100.0), 1: _doc(0.6, 90.0), 2: _doc(0.4, 120.0)}
    doc = spread.spread(docs)
    assert doc["seeds"] == [42, 1, 2]
    ttft = doc["ratios"]["trimtab"]["ttft_p99_vs_least_request"]
    assert ttft == {"min": pytest.approx(0.1), "median": pytest.approx(0.2),
                    "max": pytest.approx(0.3), "n": 3}
    tokens = doc["ratios"]["trimtab"]["output_tokens_per_s_vs_reference"]
    assert (tokens["min"], tokens["median"], tokens["max"]) == pytest.approx((0.9, 1.0, 1.2))
    goal = doc["targets"]["ttft_p99_vs_reference"]  # 0.2, 0.6, 0.4 <= 0.5: met on 42 and 2
    assert (goal["met"], goal["of"]) == (2, 3)
    assert goal["median"] == pytest.approx(0.4)
    assert doc["targets"]["ttft_p99_vs_cswrr_orca"]["n"] == 0  # cswrr_orca never ran
    rows = spread.spread_rows(doc)
    assert ["trimtab", "ttft_p99_vs_least_request", "0.10x", "0.20x", "0.30x", "3"] in rows
    assert not [r for r in rows if r[1].endswith(f"_vs_{r[0]}")]  # no policy against itself
    assert any("met on 2 of 3 seeds" in line for line in spread.spread_lines(doc))


def test_spread_median_of_an_even_count_and_missing_values() -> None:
    docs = {1: _doc(0.2, 100.0), 2: _doc(0.6, 100.0)}
    docs[3] = {"comparison": report.comparison({"trimtab": _summary(0.4, 1.0)})}
    stats = spread.spread(docs)["ratios"]["trimtab"]["ttft_p99_vs_least_request"]
    assert stats == {"min": pytest.approx(0.1), "median": pytest.approx(0.2),
                     "max": pytest.approx(0.3), "n": 2}


def test_sim_summary_reports_peak_and_mean_in_flight() -> None:
    def sample(in_flight: int, cpu: float) -> dict[str, Any]:
        return {"cpu_seconds": cpu, "loop_lag_p50_ms": 1.0, "loop_lag_p99_ms": 2.0,
                "loop_lag_max_ms": 3.0, "in_flight": in_flight,
                "servers": {"h": {"running": in_flight, "waiting": 0, "kv_usage": 0.1}}}

    samples = [(0.0, sample(500, 0.0)), (2.0, sample(100, 1.0)), (4.0, sample(300, 2.0)),
               (6.0, sample(200, 3.0)), (8.0, sample(0, 4.0))]
    # the warm-up sample (t=0) and the drain after the schedule (t=8) do not count
    summary = report.sim_summary(samples, since=1.0, until=6.0)
    assert summary["in_flight_peak"] == 300
    assert summary["in_flight_mean"] == pytest.approx(200.0)
    assert summary["cpu_percent"] == pytest.approx(50.0)
    assert report.sim_summary(samples, since=1.0)["in_flight_mean"] == pytest.approx(150.0)
    assert summary["peak_per_server"]["h"]["running"] == 300
    entry = {"client": {"loop_lag_p99_ms": 1.0, "cpu_seconds": 2.0}, "sim": summary,
             "summary": {"unfinished": 0}, "drain_before_s": 0.0}
    row = report.health_rows({"policies": {"least_request": entry}})[0]
    streams = dict(zip(report.HEALTH_COLUMNS, row, strict=True))
    assert (streams["streams peak"], streams["streams mean"]) == ("300", "200")


def test_seeds_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trimtab_dev.bench.cli import seed_dirs
    from trimtab_dev.bench.options import build_parser

    assert build_parser().parse_args(["--out", "x", "--seeds", "42,1,2"]).seeds == (42, 1, 2)
    for bad in ("1,1", "a,b", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--out", "x", "--seeds", bad])
    code = bench_main(["--fleet", "examples/fleet-hetero.yaml", "--workload",
                       "examples/workload-mixed.yaml", "--seed", "1", "--seeds", "2,3",
                       "--out", str(tmp_path)])
    assert code == 2 and "exclude each other" in capsys.readouterr().err
    for name in ("seed-2", "seed-10", "seed-x", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "bench.json").write_text("{}")
    (tmp_path / "seed-7").mkdir()  # no bench.json: not a finished run
    assert seed_dirs(tmp_path) == {10: tmp_path / "seed-10", 2: tmp_path / "seed-2"}
    assert bench_main(["--report-only", "--out", str(tmp_path / "other" / "none")]) == 2


def test_the_reference_policy_is_exactly_the_issues_formula() -> None:
    """trimtab serve with weights.policy reference computes reference_weights
    (100 cap_norm (1 - kv) / (1 + waiting)) on any inputs, whatever the previous weights (no
    EWMA, no deadband) and the other signals."""
    import itertools

    from trimtab_dev.bench import reference
    from trimtab_dev.bench.envoy_configs import trimtab_config
    from weight_calculator.types import Observation, Sample
    from xds_server.config.load import parse_config
    from xds_server.control.weights import LatencyWindow, cluster_weights

    caps = {"127.0.0.1:1": 453776.0, "127.0.0.1:2": 167184.0, "127.0.0.1:3": 38128.0}
    config = parse_config(trimtab_config(model="m", addresses=list(caps), xds_port=1,
                                         admin_port=2, listener_port=3,
                                         weights=reference.WEIGHTS))
    pool = config.pools[0]
    kvs = (0.0, 0.004, 0.3, 0.5, 0.949, 0.95, 0.995, 1.0)
    previous, now, checked = None, 1000.0, 0
    for kv, queue, itl in itertools.product(kvs, (0.0, 40.0, 5000.0), (5.0, 400.0)):
        kv_by = {a: kv if i == 0 else kvs[(kvs.index(kv) + 3 * i) % len(kvs)]
                 for i, a in enumerate(caps)}
        obs = {a: Observation(Sample(now, {"kv_usage": kv_by[a], "queue": queue,
                                           "running": 7.0, "itl_ms": itl,
                                           "capacity": caps[a], "gpu_mem_pct": 90.0}))
               for a in caps}
        got = cluster_weights(config, pool, pool.endpoints, obs, LatencyWindow(30.0), now,
                              previous)
        assert {a: e.weight for a, e in got.endpoints.items()} == \
            reference.reference_weights(kv_by, caps, dict.fromkeys(caps, queue)), \
            (kv_by, queue, itl)
        previous, checked = got, checked + 1
    assert checked == 48
    assert reference.reference_weights({"a": 0.5, "b": 0.0}, {"a": 100.0, "b": 10.0}) == \
        {"a": 50, "b": 10}
    assert reference.reference_weights({"a": 0.5, "b": 0.0}, {"a": 100.0, "b": 10.0},
                                       {"a": 4.0, "b": 0.0}) == {"a": 10, "b": 10}


def test_inflight_series_and_the_per_policy_plot(tmp_path: Path) -> None:
    """bench.png gets one row per policy: Envoy's weight per host and each server's
    running + waiting over time (the simulator's samples)."""
    from trimtab_dev.bench.report import inflight_series, write_png

    samples = [(float(t), {"servers": {"h100": {"running": t, "waiting": 0, "kv_usage": 0.1},
                                       "l4": {"running": 2, "waiting": t % 3,
                                              "kv_usage": 0.5}}}) for t in range(0, 20, 2)]
    series = inflight_series(samples)
    assert series["h100"][3] == [6.0, 6] and series["l4"][2] == [4.0, 3]
    entry = {"summary": {"per_server": {"h100": {"count": 9}, "l4": {"count": 1}}},
             "envoy_weights": {"h100": [[0.0, 100], [10.0, 90]], "l4": [[0.0, 8], [10.0, 1]]},
             "inflight": series}
    doc = {"config": {"fleet": "f", "workload": "w", "rate": 1.0, "warmup": 2.0}, "seed": 1,
           "policies": {"least_request": entry, "trimtab": entry}}
    path = tmp_path / "bench.png"
    assert write_png(doc, {"least_request": [0.1, 0.2], "trimtab": [0.1]}, path)
    from PIL import Image  # matplotlib depends on Pillow

    width, height = Image.open(path).size
    assert height > width * 0.5  # three rows of panels, not the old single row


def test_effective_shares_follow_localities_then_host_weights() -> None:
    """The bench plots, for trimtab's legs, the share of new requests each host's weight and
    locality give it: with capacity tiers the host weights alone are flat."""
    from trimtab_dev.bench.report import effective_shares

    def host(weight: int, locality: str | None, lw: int | None, health: str = "HEALTHY"):
        return {"weight": weight, "health": health, "locality": locality,
                "locality_weight": lw}

    tiered = {"h0": host(100, "big", 100), "h1": host(100, "big", 100),
              "a0": host(100, "small", 25), "a1": host(100, "small", 25, "DEGRADED"),
              "l0": host(1, "tiny", 1, "STANDBY")}
    shares = effective_shares(tiered)
    small = 25 * 0.7  # one of two hosts healthy: Envoy counts 1.4 x 1/2 of the locality
    assert shares["h0"] == pytest.approx(50 / (100 + small))
    assert shares["a0"] == pytest.approx(small / (100 + small))
    assert shares["a1"] == shares["l0"] == 0.0
    assert sum(shares.values()) == pytest.approx(1.0)
    plain = effective_shares({"x": host(30, None, None), "y": host(10, None, None)})
    assert plain == {"x": pytest.approx(0.75), "y": pytest.approx(0.25)}


def test_a_ttft_slo_turns_admission_on_for_trimtab_only(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from trimtab_dev.bench import envoy_configs
    config = envoy_configs.trimtab_config(model="m", addresses=["127.0.0.1:1"], xds_port=1,
                                          admin_port=2, listener_port=3, ttft_slo_s=3.0)
    assert [p["slo"] for p in config["pools"]] == [{"ttft_seconds": 3.0}]
    fair = envoy_configs.trimtab_config(model="m", addresses=["127.0.0.1:1"], xds_port=1,
                                        admin_port=2, listener_port=3, ttft_slo_s=3.0,
                                        tenant_header="x-tenant")
    assert [p["admission"] for p in fair["pools"]] == [{"tenant_header": "x-tenant"}]
    plain = envoy_configs.trimtab_config(model="m", addresses=["127.0.0.1:1"], xds_port=1,
                                         admin_port=2, listener_port=3)
    assert all("slo" not in p for p in plain["pools"])
    code = bench_main(["--fleet", "examples/fleet-hetero.yaml", "--workload",
                       "examples/workload-mixed.yaml", "--ttft-slo", "0", "--out", str(tmp_path)])
    assert code == 2 and "--ttft-slo must be > 0" in capsys.readouterr().err
