"""The admission budget (weight_calculator/admission.py): what a pool may hold in flight so a
new request still starts within its TTFT SLO, from the queueing policy's measurements."""

from __future__ import annotations

import pytest

from weight_calculator.admission import AdmissionPolicy, per_envoy, pool_budget
from weight_calculator.health import HEALTHY, STANDBY
from weight_calculator.types import EndpointWeight, PoolWeights


def _ew(running: float, waiting: float, mu: float | None = 2000.0, c: float | None = 1000.0,
        health: str = HEALTHY) -> EndpointWeight:
    breakdown = {}
    if mu is not None:
        breakdown["service_rate_used"] = mu
    if c is not None:
        breakdown["work_per_request"] = c
    return EndpointWeight(50, False, False, {"running": running, "queue": waiting}, 0.0, "ok",
                          health, breakdown)


def _pool(**endpoints: EndpointWeight) -> PoolWeights:
    return PoolWeights(endpoints, fail_static=False)


def test_the_budget_is_what_runs_plus_the_queue_that_starts_within_the_slo() -> None:
    # full engines (waiting > 0): R = 8 each; 2 completions/s x 0.75 x 2 s = 3 may queue
    budget = pool_budget(_pool(a=_ew(8, 4), b=_ew(8, 4)), AdmissionPolicy(2.0))
    assert budget.in_flight == 22 and budget.serving == 16
    slower = pool_budget(_pool(a=_ew(8, 4, mu=1000.0), b=_ew(8, 4, mu=1000.0)),
                         AdmissionPolicy(2.0))
    assert slower.in_flight == 2 * (8 + 1)  # half the rate: a third of the queue (floor 1.5)


def test_a_longer_slo_admits_more_and_never_less_than_what_runs() -> None:
    short = pool_budget(_pool(a=_ew(8, 4)), AdmissionPolicy(0.1))
    long = pool_budget(_pool(a=_ew(8, 4)), AdmissionPolicy(10.0))
    assert short.in_flight == 8  # no queue fits: what the engine runs is the floor
    assert long.in_flight == 8 + 15


def test_nothing_measured_admits_everything() -> None:
    budget = pool_budget(_pool(a=_ew(3, 0, mu=None), b=_ew(2, 0, c=None)), AdmissionPolicy(2.0))
    assert budget.in_flight is None and "admit everything" in budget.reason
    held = pool_budget(PoolWeights({"a": _ew(8, 4)}, fail_static=True), AdmissionPolicy(2.0))
    assert held.in_flight is None and "fail-static" in held.reason


def test_a_serving_endpoint_without_a_measured_rate_leaves_the_pool_unbudgeted() -> None:
    # one engine measured, one not (full for a moment at start-up): admit everything
    mixed = pool_budget(_pool(a=_ew(8, 4), b=_ew(2, 4, mu=None)), AdmissionPolicy(2.0))
    assert mixed.in_flight is None and "1 serving endpoint" in mixed.reason

def test_running_capacity_is_the_most_seen_and_drifts_down_only_while_full() -> None:
    policy = AdmissionPolicy(2.0)
    first = pool_budget(_pool(a=_ew(8, 4)), policy)
    quiet = pool_budget(_pool(a=_ew(2, 0)), policy, first)
    assert quiet.endpoints["a"].running_capacity == 8  # a quiet read does not lower it
    fuller = pool_budget(_pool(a=_ew(16, 4)), policy, quiet)
    assert fuller.endpoints["a"].running_capacity == 16  # more running: at once
    blocked = pool_budget(_pool(a=_ew(2, 4)), policy, fuller)  # full with 2 (a long prefill)
    assert blocked.endpoints["a"].running_capacity == pytest.approx(16 - 1.4)


def test_standby_endpoints_take_no_part() -> None:
    budget = pool_budget(_pool(a=_ew(8, 4), b=_ew(8, 4, health=STANDBY)), AdmissionPolicy(2.0))
    assert budget.in_flight == 11


def test_retry_after_is_the_time_to_finish_what_is_held_beyond_the_budget() -> None:
    # 2 servers x 2 completions/s; 40 held against a budget of 22: 19 to finish at 4/s
    budget = pool_budget(_pool(a=_ew(8, 12), b=_ew(8, 12)), AdmissionPolicy(2.0))
    assert budget.in_flight == 22
    assert budget.retry_after_s == pytest.approx((40 - 22 + 1) / 4)


def test_every_envoy_holds_an_even_part_rounded_up() -> None:
    assert per_envoy(22, 1) == 22 and per_envoy(22, 4) == 6 and per_envoy(3, 10) == 1


@pytest.mark.parametrize("kwargs", [{"ttft_seconds": 0}, {"ttft_seconds": 1, "wait_fraction": 0},
                                    {"ttft_seconds": 1, "wait_fraction": 1.5}])
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(**kwargs)
