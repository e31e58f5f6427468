"""Capacity tiers: the endpoints of a pool that are the same hardware. Pure.

Two endpoints with the same KV-cache capacity (``vllm:cache_config_info``'s blocks x block
size) run the same model on the same board with the same memory setting: identical
servers. The queueing policy measures one service rate per tier (pooled over its members,
so a twin that happened to see no queue is not left unmeasured) and sends each tier to Envoy
as one locality: the locality weight carries the tier's share of the pool, and inside it
every host has the same weight, so Envoy's least_request picks among identical servers by
their active requests (power of two choices) instead of by a weighted schedule. On the
simulated heterogeneous fleet that alone moved the P99 TTFT of a fixed split from 3.09 s
(weighted round robin) to 2.56 s (docs/results/weights.md, round 3).

An endpoint's tier is the run of capacities, largest first, within ``tolerance`` of the
run's largest; an endpoint whose capacity is unknown is in the tier ``unknown``. Names are
``kv<tokens of the tier's largest member>``: stable while the hardware is.

Equal memory does not always mean equal speed (two boards with the same memory, a throttled
GPU, a noisy neighbour): :func:`split_by_rate` splits a tier whose members' own measured
rates differ by more than ``SPLIT_FACTOR`` (the slower ones become ``<tier>-2``, ...), and
joins them again once they are within ``MERGE_FACTOR``; the gap between the two keeps the
noise of two estimates of identical servers (a few tens of percent over a window) from
splitting twins back and forth.
"""

from __future__ import annotations

from collections.abc import Mapping

TIER_TOLERANCE = 0.10  # capacities within 10 % of a tier's largest are the same hardware
UNKNOWN = "unknown"
SPLIT_FACTOR = 2.5  # members measured this much slower than the tier's fastest leave it
MERGE_FACTOR = 1.6  # ... and come back once within this factor


def capacity_tiers(capacities: Mapping[str, float | None],
                   tolerance: float = TIER_TOLERANCE) -> dict[str, str]:
    """address -> tier name (see the module docstring), for every address given."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    tiers = {a: UNKNOWN for a, c in capacities.items() if not c or c <= 0}
    known = sorted(((c, a) for a, c in capacities.items() if c and c > 0),
                   key=lambda ca: (-ca[0], ca[1]))
    head: float | None = None
    for c, a in known:
        if head is None or c < head * (1.0 - tolerance):
            head = c
        tiers[a] = f"kv{int(head)}"
    return tiers


def members(tiers: Mapping[str, str]) -> dict[str, list[str]]:
    """tier -> its addresses, sorted."""
    out: dict[str, list[str]] = {}
    for address in sorted(tiers):
        out.setdefault(tiers[address], []).append(address)
    return out


def split_by_rate(tiers: Mapping[str, str], rates: Mapping[str, float | None],
                  previous: Mapping[str, str | None],
                  floors: Mapping[str, float | None] | None = None) -> dict[str, str]:
    """``tiers`` with each tier's members regrouped by their own measured ``rates`` (see the
    module docstring). A member not measured counts at the tier's fastest measured rate, or
    at its ``floors`` entry (its throughput: it did at least that much) when that is higher:
    low traffic is no evidence of a slow server, a throughput above a twin's rate is
    evidence of a fast one. ``previous``: each endpoint's locality last tick (a tier split
    then uses ``MERGE_FACTOR`` to stay split)."""
    out = dict(tiers)
    floors = floors or {}
    for tier, addresses in members(tiers).items():
        measured = {a: r for a in addresses if (r := rates.get(a)) and r > 0}
        if not measured or len(addresses) < 2:
            continue
        top = max(measured.values())
        effective = {a: measured.get(a, max(top, floors.get(a) or 0.0)) for a in addresses}
        ordered = sorted(addresses, key=lambda a: (-effective[a], a))
        was_split = any((previous.get(a) or tier) != tier for a in addresses)
        factor = MERGE_FACTOR if was_split else SPLIT_FACTOR
        head, k = effective[ordered[0]], 1
        for a in ordered:
            if effective[a] * factor < head:
                head, k = effective[a], k + 1
            out[a] = tier if k == 1 else f"{tier}-{k}"
    return out
