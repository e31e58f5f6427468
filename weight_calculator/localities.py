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


# -- the share of new requests Envoy gives each host ---------------------------------------

PANIC_PERCENT = 50  # Envoy's default healthy_panic_threshold


@dataclass(frozen=True)
class EdsHost:
    """One host as EDS publishes it: its weight, locality (None: the default one) and that
    locality's weight, its priority and its EDS health (HEALTHY, DEGRADED, or DRAINING,
    which Envoy routes nothing new to)."""

    weight: float
    locality: str | None = None
    locality_weight: float = 1.0
    priority: int = 0
    status: str = "HEALTHY"


def eds_host(weight: float, health: str | None, locality: str | None = None,
             locality_weight: float | None = None, drain: bool = False) -> EdsHost:
    """What EDS says for an endpoint of this weight and trimtab health (as
    ``xds_server/envoy/build.py`` publishes it): STANDBY is priority 1, DEGRADED is EDS
    DEGRADED, a drained endpoint DRAINING, everything else (STALE, WARMING, INVALID
    included: expressed through the weight) HEALTHY."""
    status = "DRAINING" if drain else "DEGRADED" if health == "DEGRADED" else "HEALTHY"
    return EdsHost(float(max(1, weight)), locality,
                   float(locality_weight) if locality_weight else 1.0,
                   1 if health == "STANDBY" else 0, status)


def _distribute(availability: list[int], total: int, normalised: int) -> tuple[list[int], int]:
    """Envoy's ``distributeLoad``: each priority in turn takes its availability's part of
    ``total`` (percent); returns the parts and what is left."""
    load = []
    for value in availability:
        part = min(total, value * 100 // normalised)
        load.append(part)
        total -= part
    return load, total


def effective_shares(hosts: Mapping[str, EdsHost],
                     overprovisioning: float = OVERPROVISIONING) -> dict[str, float]:
    """Each host's expected share (0..1) of a cluster's new requests, computed the way Envoy
    routes them (``LoadBalancerBase::recalculatePerPriorityState`` and locality-weighted
    picking): a priority's availability is ``min(100, 1.4 x healthy / hosts)`` percent, its
    degraded hosts' likewise up to what is left; the load goes to priority 0's healthy hosts
    first, then the next priority's, and to DEGRADED hosts only when the healthy ones fall
    short. Inside a priority a locality is picked by ``locality_weight x min(1, 1.4 x
    healthy / hosts)`` and a host inside it by weight. A priority whose healthy and degraded
    hosts are under half (the panic threshold) spreads its load over all of its hosts.
    Envoy's least_request divisor (active requests), which acts between ticks, is left out:
    these are the shares the weights ask for."""
    out = {address: 0.0 for address in hosts}
    if not hosts:
        return out
    if all(h.priority > 0 for h in hosts.values()):  # build.py publishes them at priority 0
        hosts = {a: EdsHost(h.weight, h.locality, h.locality_weight, 0, h.status)
                 for a, h in hosts.items()}
    factor = int(round(overprovisioning * 100))
    priorities = sorted({h.priority for h in hosts.values()})
    members = [{a: h for a, h in hosts.items() if h.priority == p} for p in priorities]
    health, degraded = [], []
    for group in members:
        n = len(group)
        up = sum(1 for h in group.values() if h.status == "HEALTHY")
        down = sum(1 for h in group.values() if h.status == "DEGRADED")
        health.append(min(100, factor * up // n))
        degraded.append(min(100 - health[-1], factor * down // n))
    normalised = min(100, sum(health) + sum(degraded))
    if normalised == 0:  # nothing available: Envoy panics at priority 0
        healthy_load, degraded_load = [100] + [0] * (len(members) - 1), [0] * len(members)
    else:
        healthy_load, left = _distribute(health, 100, normalised)
        degraded_load, left = _distribute(degraded, left, normalised)
        if left:  # rounding: to the first priority with healthy hosts, else degraded ones
            first = next((i for i, v in enumerate(health) if v > 0), None)
            if first is not None:
                healthy_load[first] += left
            else:
                degraded_load[next(i for i, v in enumerate(degraded) if v > 0)] += left
    for index, group in enumerate(members):
        n = len(group)
        panic = normalised < 100 and 100 * sum(
            1 for h in group.values() if h.status in ("HEALTHY", "DEGRADED")) < PANIC_PERCENT * n
        if panic:
            _spread(out, group, (healthy_load[index] + degraded_load[index]) / 100, None, 1.0)
            continue
        _spread(out, group, healthy_load[index] / 100, "HEALTHY", overprovisioning)
        _spread(out, group, degraded_load[index] / 100, "DEGRADED", overprovisioning)
    return out


def _spread(out: dict[str, float], group: Mapping[str, EdsHost], load: float,
            status: str | None, overprovisioning: float) -> None:
    """Add ``load`` over ``group``'s hosts of ``status`` (None: every host): by effective
    locality weight, then by host weight inside the locality."""
    if load <= 0:
        return
    localities: dict[str | None, list[str]] = {}
    for address, host in group.items():
        localities.setdefault(host.locality, []).append(address)
    effective: dict[str | None, float] = {}
    for name, addresses in localities.items():
        chosen = [a for a in addresses if status is None or group[a].status == status]
        if chosen:
            weight = max(group[a].locality_weight for a in addresses)
            effective[name] = weight * min(1.0, overprovisioning * len(chosen) / len(addresses))
    total = sum(effective.values())
    if total <= 0:
        return
    for name, weight in effective.items():
        chosen = [a for a in localities[name] if status is None or group[a].status == status]
        inside = sum(group[a].weight for a in chosen)
        for a in chosen:
            out[a] += load * (weight / total) * group[a].weight / inside


def document_shares(endpoints: Mapping[str, Mapping[str, object]]) -> dict[str, float]:
    """:func:`effective_shares` of one cluster's endpoints as ``/v1/weights`` shows them
    (``weight``, ``health``, ``locality``, ``locality_weight``, ``drain``): the one
    computation the status page, ``trimtab weights``, the bench and the demo table share."""
    def number(value: object, default: int) -> int:
        return int(value) if isinstance(value, (int, float)) and value else default

    return effective_shares({
        address: eds_host(number(e.get("weight"), 1), e.get("health"),  # type: ignore[arg-type]
                          e.get("locality"), e.get("locality_weight"),  # type: ignore[arg-type]
                          bool(e.get("drain")))
        for address, e in endpoints.items()})
