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
GPU, a noisy neighbour). Inside a tier Envoy's least_request sends a new request to the
member with the fewest requests in flight, which by itself gives a slower member less
traffic (it keeps its requests longer). Splitting a tier by each member's own measured rate
was tried and left out: a single server's rate over a window swings several-fold in the
simulator (vLLM counts a long prompt's tokens only when its prefill ends), so twins were
split apart and one put on standby on noise (docs/results/weights.md, round 3).
"""

from __future__ import annotations

from collections.abc import Mapping

TIER_TOLERANCE = 0.10  # capacities within 10 % of a tier's largest are the same hardware
UNKNOWN = "unknown"


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
