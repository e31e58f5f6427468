"""Tenant fairness: the request rate each tenant may send a pool through one Envoy while the
pool is pressed (the *cap*), found by feedback. Pure: this tick's budget, the number of
Envoys and the previous cap in, a cap out.

Envoy keeps one token bucket per tenant (``envoy.admission``), all at the same rate ``c``.
Nobody tells trimtab how many tenants there are or what each asks; it sees only what the
pool's servers hold. Lowering ``c`` while the servers hold too much and raising it while
they have room is water-filling: the tenants asking less than ``c`` get all they ask, the
ones asking more are held at ``c``, and ``c`` settles where the pool is just full (max-min
fairness). The signals, from :class:`~weight_calculator.admission.PoolBudget`:

* **pressed**: the queue at the servers (``held - serving``) fills more than half of the
  queue the budget allows (``in_flight - serving``). Not "held over the budget": Envoy's
  circuit breaker keeps what is held at the budget, so it is never over; half the queue
  keeps the admitted requests' wait well inside the SLO while the cap finds its level.
  While pressed, ``c`` falls by ``DOWN`` levels a tick, unless the queue is already
  shrinking (what was lowered has not shown yet in the servers' queue).
* **slack**: the servers hold less than they run at once (no queue): ``c`` rises by ``UP``
  levels a tick, never above the pool's whole completion rate over the Envoys (``start``:
  no tenant can be held by that).
* Enforcement starts when the pool is first pressed, from a level under ``start``, and
  stops after ``RELEASE_TICKS`` slack ticks in a row with ``c`` back at ``start``.

``c`` moves in levels, ``2 ** (level / LEVELS_PER_DOUBLING)`` requests a second, so the
route configuration it lives in (token buckets have no runtime override) changes only when
the level does; unenforced, a level one step from ``start`` is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weight_calculator.admission import PoolBudget

LEVELS_PER_DOUBLING = 4  # a level is 2 ** (1/4), 19 %
MIN_LEVEL = -6 * LEVELS_PER_DOUBLING  # 1/64 request a second
DOWN = 2  # levels a pressed tick lowers the cap: x0.71
UP = 1  # levels a slack tick raises it: x1.19
RELEASE_TICKS = 3
PRESSED_QUEUE = 0.5  # of the queue the budget allows


@dataclass(frozen=True)
class TenantCap:
    """``level``: the cap, :func:`rate_of` it requests a second per tenant per Envoy;
    ``enforced``: whether Envoy refuses over it; ``held``: what the servers held at this
    tick (the next tick compares); ``calm``: slack ticks in a row while enforced."""

    level: int
    enforced: bool
    held: float = 0.0
    calm: int = 0

    @property
    def rate(self) -> float:
        return rate_of(self.level)


def rate_of(level: int) -> float:
    return float(2.0 ** (level / LEVELS_PER_DOUBLING))


def level_of(rate: float) -> int:
    """The lowest level whose rate is at least ``rate`` (and at least :data:`MIN_LEVEL`)."""
    if rate <= rate_of(MIN_LEVEL):
        return MIN_LEVEL
    return math.ceil(LEVELS_PER_DOUBLING * math.log2(rate) - 1e-9)


def pressed(budget: PoolBudget) -> bool:
    """The servers queue more than half of what the budget lets wait (at least one)."""
    if budget.in_flight is None:
        return False
    allowed = budget.in_flight - budget.serving
    return budget.held - budget.serving >= max(1.0, PRESSED_QUEUE * allowed)


def slack(budget: PoolBudget) -> bool:
    """The servers hold less than they run at once: nothing waits."""
    return budget.held < budget.serving


def start_level(budget: PoolBudget, envoys: int) -> int:
    """The pool's whole completion rate shared by the Envoys: a cap no tenant is held by."""
    return level_of(budget.rate / max(1, envoys))


def next_cap(budget: PoolBudget, envoys: int, previous: TenantCap | None) -> TenantCap | None:
    """This tick's cap; None while the pool has no measured budget (no tenant limit)."""
    if budget.in_flight is None or budget.rate <= 0:
        return None
    start = start_level(budget, envoys)
    if previous is None or not previous.enforced:
        return _idle(budget, start, previous)
    return _enforced(budget, start, previous)


def _idle(budget: PoolBudget, start: int, previous: TenantCap | None) -> TenantCap:
    level = previous.level if previous is not None and abs(previous.level - start) <= 1 \
        else start
    if pressed(budget):
        return TenantCap(max(MIN_LEVEL, min(level, start) - DOWN), True, budget.held)
    return TenantCap(level, False, budget.held)


def _enforced(budget: PoolBudget, start: int, previous: TenantCap) -> TenantCap:
    level, calm = previous.level, 0
    if pressed(budget):
        if budget.held >= previous.held:  # not shrinking yet: lower
            level -= DOWN
    elif slack(budget):
        level, calm = level + UP, previous.calm + 1
    level = max(MIN_LEVEL, min(level, start))
    if calm >= RELEASE_TICKS and level >= start:
        return TenantCap(start, False, budget.held)
    return TenantCap(level, True, budget.held, calm)
