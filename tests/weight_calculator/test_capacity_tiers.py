"""Capacity tiers: identical servers by KV capacity, split again by measured rate."""

from __future__ import annotations

import pytest

from weight_calculator.capacity_tiers import (
    MERGE_FACTOR,
    SPLIT_FACTOR,
    UNKNOWN,
    capacity_tiers,
    members,
    split_by_rate,
)

H100, A100, L4 = 453_776.0, 167_184.0, 38_128.0


def test_endpoints_of_one_capacity_share_a_tier_named_by_it() -> None:
    tiers = capacity_tiers({"h0": H100, "h1": H100, "a0": A100, "a1": A100 * 0.95, "l": L4,
                            "x": None, "y": 0.0})
    assert tiers == {"h0": "kv453776", "h1": "kv453776", "a0": "kv167184", "a1": "kv167184",
                     "l": "kv38128", "x": UNKNOWN, "y": UNKNOWN}
    assert members(tiers)["kv167184"] == ["a0", "a1"]
    # beyond the tolerance: another tier, named by its own largest member
    assert capacity_tiers({"a": 100.0, "b": 85.0})["b"] == "kv85"
    assert capacity_tiers({"a": 100.0, "b": 85.0}, tolerance=0.2) == {"a": "kv100", "b": "kv100"}
    with pytest.raises(ValueError, match="tolerance"):
        capacity_tiers({"a": 1.0}, tolerance=1.0)


def test_a_member_measured_much_slower_than_its_twins_leaves_the_tier() -> None:
    tiers = {"a": "t", "b": "t", "c": "t"}
    same = split_by_rate(tiers, {"a": 6000.0, "b": 6000.0 / (SPLIT_FACTOR * 0.9), "c": None},
                         {})
    assert same == tiers  # noise between twins keeps them together
    split = split_by_rate(tiers, {"a": 6000.0, "b": 6000.0 / (SPLIT_FACTOR * 1.1), "c": None},
                          {})
    assert split == {"a": "t", "b": "t-2", "c": "t"}  # the unmeasured one stays with the fast
    # once split, it comes back only within MERGE_FACTOR
    previous = {"a": "t", "b": "t-2", "c": "t"}
    held = split_by_rate(tiers, {"a": 6000.0, "b": 6000.0 / (MERGE_FACTOR * 1.1)}, previous)
    assert held["b"] == "t-2"
    back = split_by_rate(tiers, {"a": 6000.0, "b": 6000.0 / (MERGE_FACTOR * 0.9)}, previous)
    assert back["b"] == "t"


def test_throughput_is_evidence_of_a_fast_member_never_of_a_slow_one() -> None:
    tiers = {"fast": "t", "slow": "t"}
    # "fast" never queued (no rate) but did 10x what "slow" measured at capacity
    split = split_by_rate(tiers, {"slow": 1000.0}, {}, floors={"fast": 10_000.0})
    assert split == {"fast": "t", "slow": "t-2"}
    # a member with little traffic is not slower for it
    kept = split_by_rate(tiers, {"slow": 6000.0}, {}, floors={"fast": 50.0})
    assert kept == tiers
    assert split_by_rate({"a": "t"}, {"a": 5.0}, {}) == {"a": "t"}  # alone: nothing to split
