"""The tenant cap (weight_calculator/fairness.py), on a synthetic pool: a fluid queue of
capacity C requests a second, R running at once and Q allowed to wait (the budget R + Q,
the circuit breaker refusing past it), fed by tenants with fixed demands, each held at the
cap while it is enforced. The cap is read from the servers' state after the previous tick,
as trimtab reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from weight_calculator.admission import PoolBudget
from weight_calculator.fairness import (
    MIN_LEVEL,
    RELEASE_TICKS,
    TenantCap,
    level_of,
    next_cap,
    pressed,
    rate_of,
)

C, R, Q = 40.0, 32, 24  # requests/s the pool finishes, runs at once, may queue


@dataclass
class Pool:
    """The fluid model: each tick, what every tenant got through and what the queue holds."""

    queue: float = 0.0
    admitted: float = 0.0
    cap: TenantCap | None = None
    caps: list[TenantCap | None] = field(default_factory=list)

    def budget(self) -> PoolBudget:
        held = R + self.queue if self.queue > 0 else R * min(1.0, self.admitted / C)
        return PoolBudget(R + Q, R, 1.0, held=held, rate=C)

    def tick(self, demands: list[float], fair: bool = True) -> list[float]:
        """Served per tenant this tick (after the tenant cap and the circuit breaker)."""
        if fair:
            self.cap = next_cap(self.budget(), 1, self.cap)
        self.caps.append(self.cap)
        limit = self.cap.rate if self.cap is not None and self.cap.enforced else float("inf")
        asked = [min(d, limit) for d in demands]
        total = sum(asked)
        room = Q - self.queue + C  # what the queue can take this tick and still finish
        kept = 1.0 if total <= room else room / total  # the breaker refuses the excess
        self.admitted = total * kept
        self.queue = min(Q, max(0.0, self.queue + self.admitted - C))
        return [a * kept for a in asked]


def _run(pool: Pool, demands: list[float], ticks: int, fair: bool = True) -> list[list[float]]:
    return [pool.tick(demands, fair) for _ in range(ticks)]


def _mean(rows: list[list[float]], tenant: int) -> float:
    return sum(row[tenant] for row in rows) / len(rows)


def test_a_flooding_tenant_is_held_at_the_water_level_and_the_others_get_their_demand() -> None:
    # four tenants, a share of 10/s each; three ask 7/s, one floods at 5x its share
    demands = [7.0, 7.0, 7.0, 50.0]
    served = _run(Pool(), demands, 80)[-40:]
    for tenant in range(3):
        assert _mean(served, tenant) >= 0.97 * 7.0, tenant
    water = C - 3 * 7.0  # 19/s is left for the flooder, between two levels
    assert 0.7 * water <= _mean(served, 3) <= 1.15 * water
    assert sum(_mean(served, t) for t in range(4)) >= 0.85 * C  # the pool stays busy


def test_without_the_cap_the_flood_takes_most_of_the_others_share() -> None:
    served = _run(Pool(), [7.0, 7.0, 7.0, 50.0], 80, fair=False)[-40:]
    assert _mean(served, 0) < 0.6 * 7.0  # the breaker refuses everyone alike


def test_many_tenants_converge_to_equal_shares() -> None:
    demands = [30.0] * 8  # everyone over a fair share of 5/s
    pool = Pool()
    served = _run(pool, demands, 100)[-50:]
    means = [_mean(served, t) for t in range(8)]
    assert max(means) - min(means) < 1e-9  # one cap for all
    assert 0.8 * C / 8 <= means[0] <= 1.2 * C / 8


def test_a_pool_within_capacity_is_never_enforced() -> None:
    pool = Pool()
    _run(pool, [8.0, 8.0, 8.0, 10.0], 40)
    assert all(cap is not None and not cap.enforced for cap in pool.caps)
    assert pool.caps[-1] is not None and pool.caps[-1].level == level_of(C)


def test_enforcement_stops_once_the_flood_is_over() -> None:
    pool = Pool()
    _run(pool, [8.0, 8.0, 8.0, 50.0], 40)
    assert pool.cap is not None and pool.cap.enforced
    _run(pool, [8.0, 8.0, 8.0, 8.0], 40)
    assert pool.cap is not None and not pool.cap.enforced
    assert pool.cap.level == level_of(C)
    released = next(i for i, cap in enumerate(pool.caps[40:]) if cap and not cap.enforced)
    assert released >= RELEASE_TICKS


def test_the_cap_is_quantised_and_bounded() -> None:
    assert [level_of(rate_of(k)) for k in (-8, 0, 5, 17)] == [-8, 0, 5, 17]
    assert level_of(1.0) == 0 and level_of(1.01) == 1 and level_of(0.0) == MIN_LEVEL
    assert rate_of(4) == pytest.approx(2.0)


def test_a_pool_without_a_budget_has_no_cap() -> None:
    unmeasured = PoolBudget(None, 8, 0.0, held=100.0)
    assert next_cap(unmeasured, 1, None) is None and not pressed(unmeasured)


def test_a_shrinking_queue_holds_the_cap_where_it_is() -> None:
    budget = PoolBudget(R + Q, R, 1.0, held=R + Q - 2, rate=C)
    before = TenantCap(10, True, held=R + Q)
    assert next_cap(budget, 1, before) == TenantCap(10, True, R + Q - 2)
    growing = TenantCap(10, True, held=R + 14)
    after = next_cap(budget, 1, growing)
    assert after is not None and after.level == 8


def test_the_cap_never_rises_above_the_pools_rate_per_envoy() -> None:
    quiet = PoolBudget(R + Q, R, 1.0, held=4.0, rate=C)
    cap = next_cap(quiet, 4, TenantCap(level_of(C / 4), True, calm=0))
    assert cap is not None and cap.level == level_of(C / 4)
