"""Degrading before refusing: the share of a pool's new requests sent straight to its
fallback pool while the pool is over its budget. Pure: the two pools' budgets and the
previous share in, a share out (per mille).

Envoy never retries a request its circuit breaker refused (measured: docs/envoy-routing-
notes.md), so the fallback cannot take over request by request; the routes instead split the
pool's traffic with its fallback, and the split follows the pool's pressure tick by tick:
up by :data:`UP` while the pool is pressed (its servers queue more than half of what the
budget lets wait, :func:`weight_calculator.fairness.pressed`) and the fallback is not, down by
:data:`DOWN` once nothing waits at the pool's servers, held otherwise. It settles where the
pool is just full, and what the fallback cannot take either is refused by its own budget.
"""

from __future__ import annotations

from weight_calculator.admission import PoolBudget
from weight_calculator.fairness import pressed, slack

UP = 100  # per mille a pressed tick adds
DOWN = 50  # per mille a slack tick takes back
FULL = 1000


def next_spill(pool: PoolBudget, fallback: PoolBudget | None, previous: int) -> int:
    """The share (per mille) of the pool's new requests to send to its fallback."""
    if pool.in_flight is None:  # no budget: nothing is refused, nothing to spill
        return 0
    if pressed(pool):
        if fallback is not None and pressed(fallback):
            return previous
        return min(FULL, previous + UP)
    if slack(pool):
        return max(0, previous - DOWN)
    return previous
