"""Degrading before refusing (weight_calculator/spill.py): the share of a pool's new requests
sent to its fallback follows the pool's pressure."""

from __future__ import annotations

from weight_calculator.admission import PoolBudget
from weight_calculator.spill import DOWN, FULL, UP, next_spill

R, Q = 16, 8  # what the servers run at once, and the queue the budget allows


def _budget(held: float) -> PoolBudget:
    return PoolBudget(R + Q, R, 1.0, held=held, rate=4.0)


PRESSED, FULLISH, SLACK = _budget(R + Q), _budget(R + 2), _budget(R - 1)


def test_a_pressed_pool_spills_more_each_tick_up_to_everything() -> None:
    share = 0
    for tick in range(1, 12):
        share = next_spill(PRESSED, None, share)
        assert share == min(FULL, tick * UP)
    assert share == FULL


def test_it_holds_while_busy_and_gives_back_once_nothing_waits() -> None:
    assert next_spill(FULLISH, None, 300) == 300  # queueing, within half the allowed queue
    assert next_spill(SLACK, None, 300) == 300 - DOWN
    assert next_spill(SLACK, None, 20) == 0


def test_a_pressed_fallback_takes_no_more() -> None:
    assert next_spill(PRESSED, PRESSED, 300) == 300
    assert next_spill(PRESSED, SLACK, 300) == 300 + UP


def test_a_pool_without_a_budget_spills_nothing() -> None:
    assert next_spill(PoolBudget(None, R, 0.0, held=100.0), None, 500) == 0
