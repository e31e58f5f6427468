"""From per-endpoint shares to Envoy localities: tier weights, host weights, tier standby."""

from __future__ import annotations

import pytest

from weight_calculator.localities import OVERPROVISIONING, plan_localities, standby_tiers

TIERS = {"h0": "h", "h1": "h", "a0": "a", "a1": "a", "l0": "l", "l1": "l"}


def _plan(shares, *, left_out=(), degraded=(), equal=True, previous=None, standby=True,
          max_share=0.5):
    return plan_localities(TIERS, shares, left_out, degraded, max_weight=100,
                           equal_hosts=equal, standby=standby, max_standby_share=max_share,
                           previous=previous or {}, smooth=lambda target, prior: target)


def test_a_tier_weighs_the_sum_of_its_members_shares_and_its_hosts_weigh_the_same() -> None:
    plan = _plan({"h0": 8.0, "h1": 8.0, "a0": 1.0, "a1": 0.6, "l0": 0.2, "l1": 0.2})
    assert plan.weights == {"h": 100, "a": 10, "l": 2}
    assert plan.standby == frozenset()
    assert set(plan.host_units.values()) == {100.0}  # least_request: power of two choices
    rr = _plan({"h0": 8.0, "h1": 8.0, "a0": 1.0, "a1": 0.5, "l0": 0.2, "l1": 0.2}, equal=False)
    assert rr.host_units["a0"] == 100.0 and rr.host_units["a1"] == 50.0  # own share in tier


def test_a_tier_left_out_by_the_split_is_on_standby_whole() -> None:
    shares = {"h0": 8.0, "h1": 8.0, "a0": 2.0, "a1": 2.0, "l0": 0.0, "l1": 0.0}
    plan = _plan(shares, left_out={"l0", "l1"})
    assert plan.standby == {"l0", "l1"} and "l0" not in plan.host_units
    assert plan.weights["l"] == 1  # irrelevant: every host DRAINING
    # below one weight unit is standby too; the budget is half the pool's endpoints
    tiny = {"h0": 90.0, "h1": 90.0, "a0": 0.4, "a1": 0.4, "l0": 0.1, "l1": 0.1}
    assert _plan(tiny, max_share=0.7).standby == {"a0", "a1", "l0", "l1"}
    # the smallest tier first, whole tiers only, at most half the pool's endpoints (3 of 6)
    assert _plan(tiny).standby == {"l0", "l1"}
    assert _plan(tiny, max_share=0.3).standby == frozenset()
    assert _plan(shares, left_out={"l0", "l1"}, standby=False).standby == frozenset()
    # one member of a tier left out and its twin not: the tier serves (standby is by tier)
    half = {"h0": 8.0, "h1": 8.0, "a0": 2.0, "a1": 2.0, "l0": 0.0, "l1": 1.0}
    assert _plan(half, left_out={"l0"}).standby == frozenset()
    assert standby_tiers({"t": 0.5}, {"t": ["x"]}, (), usable=1, max_share=0.5) == frozenset()


def test_a_degraded_member_leaves_its_tier_s_share_to_its_twin_scaled_for_envoy() -> None:
    shares = {"h0": 8.0, "h1": 8.0, "a0": 1.0, "a1": 1.0, "l0": 0.2, "l1": 0.2}
    plan = _plan(shares, degraded={"a1"})
    # Envoy multiplies a locality's weight by min(1, 1.4 x healthy / hosts): 0.7 here
    available = min(1.0, OVERPROVISIONING * 1 / 2)
    assert plan.weights["a"] == round(100 * 1.0 / 16.0 / available)
    assert "a1" not in plan.host_units
    smoothed = plan_localities(TIERS, shares, (), (), max_weight=100, equal_hosts=True,
                               standby=True, max_standby_share=0.5, previous={"a": 7},
                               smooth=lambda target, prior: prior or target)
    assert smoothed.weights["a"] == 7  # the caller's smoothing sees the previous weight


@pytest.mark.parametrize("absent", ["h1", "a0"])
def test_an_endpoint_without_a_share_still_has_a_locality(absent: str) -> None:
    shares = {a: 1.0 for a in TIERS if a != absent}  # e.g. stale: weighed elsewhere
    plan = _plan(shares)
    assert plan.tiers[absent] == TIERS[absent] and absent not in plan.host_units


# -- effective_shares: the share of new requests Envoy gives each host ----------------------

def test_effective_share_is_locality_share_times_host_share_not_host_weight_alone():
    """Issue 25 item 3: equal host weights in two tiers of 100 : 25 (and a third of 10) give
    80 : 20, not the host weights' even split the page used to show."""
    from weight_calculator.localities import EdsHost, effective_shares

    hosts = {"a": EdsHost(100, "big", 100), "b": EdsHost(100, "big", 100),
             "c": EdsHost(100, "small", 25), "d": EdsHost(100, "small", 25),
             "e": EdsHost(100, "tiny", 10)}
    shares = effective_shares(hosts)
    assert shares["a"] == pytest.approx(50 / 135) and shares["b"] == shares["a"]
    assert shares["c"] == pytest.approx(12.5 / 135)
    assert shares["e"] == pytest.approx(10 / 135)
    assert sum(shares.values()) == pytest.approx(1.0)
    # one locality: by host weight
    assert effective_shares({"x": EdsHost(30), "y": EdsHost(10)}) == {
        "x": pytest.approx(0.75), "y": pytest.approx(0.25)}


def test_standby_gets_nothing_while_priority_0_is_healthy_and_takes_over_when_it_is_not():
    from weight_calculator.localities import EdsHost, effective_shares

    serving = {f"p{i}": EdsHost(100, "big", 100) for i in range(4)}
    standby = {"s0": EdsHost(1, "small", 1, priority=1), "s1": EdsHost(1, "small", 1, priority=1)}
    shares = effective_shares(serving | standby)
    assert shares["s0"] == shares["s1"] == 0.0
    assert shares["p0"] == pytest.approx(0.25)
    # two of four priority-0 hosts DEGRADED: 1.4 x 2/4 = 70 % healthy load stays at priority
    # 0's healthy hosts, the next 30 % goes to priority 1's healthy hosts before any DEGRADED
    half = {a: (EdsHost(100, "big", 100, status="DEGRADED") if a in ("p2", "p3") else h)
            for a, h in serving.items()}
    shares = effective_shares(half | standby)
    assert shares["p0"] == pytest.approx(0.35) and shares["p2"] == 0.0
    assert shares["s0"] == pytest.approx(0.15)
    # every host on standby: build.py publishes them at priority 0, so they serve
    assert effective_shares(standby) == {"s0": pytest.approx(0.5), "s1": pytest.approx(0.5)}


def test_degraded_hosts_get_load_only_when_the_healthy_ones_fall_short():
    from weight_calculator.localities import EdsHost, effective_shares

    # 3 healthy of 4: 1.4 x 3/4 covers 100 %: the DEGRADED one gets nothing
    hosts = {"a": EdsHost(10), "b": EdsHost(10), "c": EdsHost(10), "d": EdsHost(10, status="DEGRADED")}
    assert effective_shares(hosts)["d"] == 0.0
    # 1 healthy of 3: 46 % healthy (integer percent, as Envoy), the DEGRADED take the rest
    hosts = {"a": EdsHost(10), "b": EdsHost(10, status="DEGRADED"),
             "c": EdsHost(10, status="DEGRADED")}
    shares = effective_shares(hosts)
    assert shares["a"] == pytest.approx(0.46) and shares["b"] == pytest.approx(0.27)
    # a draining host gets nothing, and thins out its locality like any unhealthy one
    drained = {"a": EdsHost(10, "x", 10), "b": EdsHost(10, "x", 10, status="DRAINING"),
               "c": EdsHost(10, "y", 10)}
    shares = effective_shares(drained)
    assert shares["b"] == 0.0
    assert shares["a"] == pytest.approx(7 / 17) and shares["c"] == pytest.approx(10 / 17)


def test_document_shares_reads_v1_weights_endpoints_as_build_publishes_them():
    from weight_calculator.localities import document_shares

    shares = document_shares({
        "a": {"weight": 100, "health": "HEALTHY", "locality": "big", "locality_weight": 100},
        "b": {"weight": 100, "health": "STALE", "locality": "small", "locality_weight": 25},
        "c": {"weight": 1, "health": "STANDBY", "locality": "tiny", "locality_weight": 1},
        "d": {"weight": 100, "health": "HEALTHY", "locality": "big", "locality_weight": 100,
              "drain": True}})
    assert shares["d"] == 0.0
    # priority 0 has 2 of its 3 hosts healthy: 140 x 2/3 = 93 % stays there, 7 % fails over
    # to the standby; big has one healthy host of two: 100 x min(1, 1.4 x 1/2) = 70 : 25
    assert shares["c"] == pytest.approx(0.07)
    assert shares["a"] == pytest.approx(0.93 * 70 / 95)
    assert shares["b"] == pytest.approx(0.93 * 25 / 95)
