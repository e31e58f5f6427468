"""From the queueing policy's per-endpoint shares to Envoy localities: one per capacity tier
(:mod:`weight_calculator.capacity_tiers`), weighted by the tier's share, and each host's
weight inside its locality. Pure.

* **Locality weight**: the sum of the shares of the tier's serving members (not DEGRADED,
  not on standby), scaled so the largest tier has ``max_weight``, divided by the share of
  the tier Envoy counts as available (Envoy multiplies a locality's weight by
  ``min(1, 1.4 x healthy hosts / hosts)``, the overprovisioning factor), then smoothed like
  an endpoint weight (relative deadband, drops at once, rises by ``rise_alpha``).
* **Host weights**: under least_request every serving member of a tier has ``max_weight``,
  so Envoy picks among identical servers by their active requests (with equal weights its
  least_request is power of two choices; with unequal ones a weighted schedule that only
  divides by the active count). Under round robin, which sees no active count, each
  member's own share (its backlog discount included) relative to the tier's largest.
* **Standby by tier**: a tier the split leaves out, or whose share is below one weight
  unit, is put on standby whole (every member in EDS priority 1), the smallest first,
  never more than ``max_standby_share`` of the pool's endpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from weight_calculator.capacity_tiers import members
from weight_calculator.inputs import MIN_WEIGHT

OVERPROVISIONING = 1.4  # Envoy's default overprovisioning_factor (140)


@dataclass(frozen=True)
class LocalityPlan:
    tiers: Mapping[str, str]  # address -> locality, every endpoint of the pool
    standby: frozenset[str]  # addresses of the tiers on standby
    weights: Mapping[str, int]  # locality -> its load_balancing_weight
    host_units: Mapping[str, float]  # serving address -> its weight target in its locality


def standby_tiers(tier_units: Mapping[str, float], groups: Mapping[str, list[str]],
                  left_out: Collection[str], usable: int, max_share: float,
                  enabled: bool = True) -> frozenset[str]:
    """Members of the tiers that get no new requests (module docstring)."""
    if not enabled:
        return frozenset()
    candidates = sorted((t for t, u in tier_units.items()
                         if u < MIN_WEIGHT or all(a in left_out for a in groups[t])),
                        key=lambda t: (tier_units[t], t))
    budget = int(max_share * usable + 1e-9)
    out: set[str] = set()
    for t in candidates:
        if len(out) + len(groups[t]) > budget:
            break
        out.update(groups[t])
    return frozenset(out)


def plan_localities(tiers: Mapping[str, str], shares: Mapping[str, float],
                    left_out: Collection[str], degraded: Collection[str], *,
                    max_weight: int, equal_hosts: bool, standby: bool,
                    max_standby_share: float, previous: Mapping[str, int],
                    smooth: Callable[[int, int | None], int]) -> LocalityPlan:
    """``shares``: the usable endpoints' traffic shares (any unit); ``tiers``: every
    endpoint's locality; ``degraded``: usable endpoints that get no share (KV full)."""
    groups = members(tiers)
    usable_groups = {t: [a for a in addrs if a in shares] for t, addrs in groups.items()}
    serving = {a: s for a, s in shares.items() if a not in degraded}
    total = {t: sum(serving.get(a, 0.0) for a in addrs) for t, addrs in usable_groups.items()}
    top = max(total.values(), default=0.0)
    tier_units = {t: max_weight * v / top if top > 0 else float(max_weight)
                  for t, v in total.items() if usable_groups[t]}
    idle = standby_tiers(tier_units, {t: usable_groups[t] for t in tier_units}, left_out,
                         len(shares), max_standby_share, standby)
    weights: dict[str, int] = {}
    for t, addrs in groups.items():
        if not any(a in serving and a not in idle for a in addrs):
            weights[t] = MIN_WEIGHT
            continue
        # what Envoy counts: every host not DEGRADED (a stale one is healthy); a tier on
        # standby is in priority 1 whole, so its members never thin out a serving tier
        healthy = sum(1 for a in addrs if a not in degraded and a not in idle)
        available = min(1.0, OVERPROVISIONING * healthy / len(addrs))
        weights[t] = smooth(round(tier_units[t] / available), previous.get(t))
    host_units: dict[str, float] = {}
    for addrs in usable_groups.values():
        own = {a: serving[a] for a in addrs if a in serving and a not in idle}
        peak = max(own.values(), default=0.0)
        for a, s in own.items():
            host_units[a] = float(max_weight) if equal_hosts or peak <= 0 else (
                max_weight * s / peak)
    return LocalityPlan(dict(tiers), idle, weights, host_units)
