"""The policy lab: Envoy's host picking as emulated there, and one short run end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from trimtab_dev.lab.__main__ import main, parse_policy, run_one
from trimtab_dev.lab.envoy_lb import DEGRADED, DRAINING, Envoy

ADDRESSES = ["a", "b", "c", "d"]


def _picks(envoy: Envoy, n: int, release: bool = True) -> Counter[str]:
    out: Counter[str] = Counter()
    for _ in range(n):
        host = envoy.pick()
        out[host.address] += 1
        if release:
            envoy.done(host)
    return out


def test_weighted_round_robin_follows_the_weights() -> None:
    envoy = Envoy("round_robin", ADDRESSES, seed=1)
    envoy.update({"a": 3, "b": 1, "c": 1, "d": 1})
    picks = _picks(envoy, 6000)
    assert picks["a"] == pytest.approx(3000, abs=60)
    assert picks["b"] == pytest.approx(1000, abs=60)


def test_least_request_with_equal_weights_picks_the_less_loaded() -> None:
    envoy = Envoy("least_request", ["a", "b"], seed=2, choices=8)
    envoy.hosts["a"].active = 5  # a has requests in flight; b has none
    picks = _picks(envoy, 200)
    assert picks["b"] >= 198  # 8 draws from two hosts miss b with probability 2 ** -8
    two = Envoy("least_request", ["a", "b"], seed=2, choices=2)
    two.hosts["a"].active = 5
    assert 120 < _picks(two, 200)["b"] < 180  # power of two choices: 3 in 4


def test_weighted_least_request_divides_by_the_active_count() -> None:
    envoy = Envoy("least_request", ["a", "b"], seed=3)
    envoy.update({"a": 2, "b": 1})
    picks = _picks(envoy, 3000, release=False)  # every pick stays in flight
    # weight / (active + 1), evaluated when a host is picked, pulls the split toward equal
    # in-flight counts: "a" gets more than "b", but less than its weight's two thirds
    assert 1500 < picks["a"] < 1900
    assert envoy.hosts["a"].active == picks["a"]
    rr = Envoy("round_robin", ["a", "b"], seed=3)
    rr.update({"a": 2, "b": 1})
    assert _picks(rr, 3000, release=False)["a"] == pytest.approx(2000, abs=5)


def test_localities_share_by_their_weights_and_health_excludes_hosts() -> None:
    envoy = Envoy("least_request", ADDRESSES, seed=4)
    envoy.update({a: 1 for a in ADDRESSES}, {},
                 {"a": "big", "b": "big", "c": "small", "d": "small"}, {"big": 4, "small": 1})
    picks = _picks(envoy, 5000)
    assert picks["a"] + picks["b"] == pytest.approx(4000, abs=80)
    envoy.update({a: 1 for a in ADDRESSES}, {"d": DRAINING})
    picks = _picks(envoy, 4000)
    assert picks["d"] == 0
    # "small" has one of two hosts left: its weight counts min(1, 1.4 x 1/2) = 0.7
    assert picks["c"] / 4000 == pytest.approx(0.7 / 4.7, abs=0.02)
    envoy.update({a: 1 for a in ADDRESSES}, {"d": DRAINING, "b": DEGRADED})
    picks = _picks(envoy, 4000)
    # two healthy hosts of four carry 1.4 x 2/4 = 70 % of the traffic, the degraded one the rest
    assert picks["b"] / 4000 == pytest.approx(0.3, abs=0.03) and picks["d"] == 0
    envoy.update({a: 1 for a in ADDRESSES}, {"a": DRAINING, "b": DRAINING, "c": DRAINING})
    assert set(_picks(envoy, 300)) == set(ADDRESSES)  # panic: under half available


def test_a_short_run_is_deterministic_and_the_cli_writes_every_run(tmp_path: Path,
                                                                   capsys) -> None:
    fleet, workload = "examples/fleet-hetero.yaml", "examples/workload-mixed.yaml"
    job = (fleet, workload, "trimtab", 3, 2.0, 6.0, 60.0, 6.0, True)
    first, again = run_one(job), run_one(job)
    assert first["ttft_p99"] == again["ttft_p99"] and first["requests"] > 20
    assert first["unfinished"] == 0 and first["trace"]
    assert parse_policy("trimtab split=square_root lb=round_robin") == (
        "trimtab", {"split": "square_root", "lb": "round_robin"})
    with pytest.raises(Exception, match="unknown policy kind"):
        parse_policy("magic")
    out = tmp_path / "lab.json"
    assert main(["--fleet", fleet, "--workload", workload, "--seeds", "1-2", "--duration", "5",
                 "--warmup", "1", "--tail", "5", "--rate", "6", "--jobs", "1",
                 "--policy", "least_request", "--policy", "reference", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {(r["policy"], r["seed"]) for r in runs} == {
        (p, s) for p in ("least_request", "reference") for s in (1, 2)}
    assert "| reference |" in capsys.readouterr().out


def test_priority_one_takes_only_what_priority_zero_cannot() -> None:
    envoy = Envoy("least_request", ADDRESSES, seed=5)
    envoy.update({a: 1 for a in ADDRESSES}, {}, priorities={"c": 1, "d": 1})
    assert set(_picks(envoy, 1000)) == {"a", "b"}  # standby: nothing while P0 is available
    envoy.update({a: 1 for a in ADDRESSES}, {"a": DEGRADED}, priorities={"c": 1, "d": 1})
    assert set(_picks(envoy, 1000)) == {"a", "b"}  # a degraded host still counts in P0
    envoy.update({a: 1 for a in ADDRESSES}, {"a": DRAINING}, priorities={"c": 1, "d": 1})
    picks = _picks(envoy, 4000)
    # P0 has one healthy host of two: 1.4 x 1/2 = 70 %; the rest fails over to P1
    assert (picks["c"] + picks["d"]) / 4000 == pytest.approx(0.3, abs=0.03)
