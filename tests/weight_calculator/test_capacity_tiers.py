"""Capacity tiers: identical servers by KV capacity, split again by measured rate."""

from __future__ import annotations

import pytest

from weight_calculator.capacity_tiers import UNKNOWN, capacity_tiers, members

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
