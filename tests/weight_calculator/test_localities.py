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
