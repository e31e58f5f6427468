"""The load generator's surge arrivals and tenants: rates in and out of the surge, the same
schedule for a seed, tenant headers, and a flooding tenant that leaves the others' requests
as they are without the flood."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from trimtab_dev.loadgen.workload import (
    PlannedRequest,
    WorkloadError,
    build_schedule,
    parse_workload,
    rate_segments,
    request_headers,
    surge_window,
)

SURGE = {"kind": "surge", "start_s": 10, "surge_s": 5, "factor": 8}
BASE: dict[str, Any] = {
    "name": "surge", "seed": 3, "rate": 20, "duration_s": 30, "arrival": SURGE,
    "classes": [{"name": "chat", "weight": 1, "prompt_tokens": {"dist": "uniform", "min": 100,
                                                                "max": 400},
                 "max_tokens": {"dist": "uniform", "min": 4, "max": 64}}],
}


def workload(**over: Any) -> Any:
    return parse_workload({**BASE, **over})


def within(count: int, mean: float, sigmas: float = 4.0) -> bool:
    """``count`` is within ``sigmas`` standard deviations of a Poisson(``mean``) draw."""
    return abs(count - mean) <= sigmas * math.sqrt(mean)


def between(plan: list[PlannedRequest], lo: float, hi: float) -> list[PlannedRequest]:
    return [p for p in plan if lo <= p.at < hi]


def test_surge_segments_are_steady_surge_steady() -> None:
    w = workload()
    assert rate_segments(w.arrival, 20.0, 30.0) == [(10, 20.0), (5, 160.0), (15, 20.0)]
    assert surge_window(w.arrival) == (10, 15)
    # a surge past the end of the run is clipped; one entirely after it leaves steady load
    assert rate_segments(w.arrival, 20.0, 12.0) == [(10, 20.0), (2, 160.0)]
    assert rate_segments(w.arrival, 20.0, 8.0) == [(8, 20.0)]
    assert surge_window(workload(arrival={"kind": "poisson"}).arrival) is None


def test_surge_rates_inside_and_outside_the_surge() -> None:
    plan = build_schedule(workload(duration_s=60), seed=11)
    assert within(len(between(plan, 0, 10)), 20 * 10)
    assert within(len(between(plan, 10, 15)), 160 * 5)
    assert within(len(between(plan, 15, 60)), 20 * 45)
    assert [p.at for p in plan] == sorted(p.at for p in plan)
    assert [p.index for p in plan] == list(range(len(plan)))


def test_surge_schedule_is_deterministic_per_seed() -> None:
    w = workload()
    assert build_schedule(w, seed=1) == build_schedule(w, seed=1)
    assert build_schedule(w, seed=1) != build_schedule(w, seed=2)


def test_surge_fields_are_validated() -> None:
    with pytest.raises(WorkloadError):
        workload(arrival={**SURGE, "factor": 0.5})
    with pytest.raises(WorkloadError):
        workload(arrival={**SURGE, "surge_s": 0})
    with pytest.raises(WorkloadError):
        workload(ttft_slo_s=0)
    assert workload(ttft_slo_s=3).ttft_slo_s == 3


def test_tenants_do_not_change_the_requests() -> None:
    plain = build_schedule(workload())
    tagged = build_schedule(workload(tenants={"header": "x-tenant", "count": 4}))
    assert [p.tenant for p in plain] == [None] * len(plain)
    strip = [(p.at, p.cls, p.prompt_tokens, p.max_tokens) for p in tagged]
    assert strip == [(p.at, p.cls, p.prompt_tokens, p.max_tokens) for p in plain]
    counts = Counter(p.tenant for p in tagged)
    assert set(counts) == {"t0", "t1", "t2", "t3"}
    assert all(within(n, len(tagged) / 4) for n in counts.values())


def test_the_tenant_travels_in_its_header() -> None:
    w = workload(tenants={"header": "x-org", "count": 2})
    p = build_schedule(w)[0]
    assert request_headers(p, w) == {"Content-Type": "application/json", "x-org": p.tenant}
    assert request_headers(build_schedule(workload())[0], workload()) == {
        "Content-Type": "application/json"}


def _others(plan: list[PlannedRequest], flooder: str) -> list[tuple[Any, ...]]:
    return [(p.at, p.tenant, p.cls, p.prompt_tokens, p.max_tokens) for p in plan
            if p.tenant != flooder]


def test_a_flooding_tenant_sends_factor_times_its_share_on_top() -> None:
    tenants = {"count": 4}
    flood = {**tenants, "flood": {"tenant": "t0", "factor": 5}}
    calm = build_schedule(workload(duration_s=60, tenants=tenants))
    flooded = build_schedule(workload(duration_s=60, tenants=flood))
    assert _others(flooded, "t0") == _others(calm, "t0")  # the others' requests unchanged
    counts = Counter(p.tenant for p in flooded)
    others = (counts["t1"] + counts["t2"] + counts["t3"]) / 3
    assert 4.0 < counts["t0"] / others < 6.0
    assert [p.index for p in flooded] == list(range(len(flooded)))
    assert [p.at for p in flooded] == sorted(p.at for p in flooded)


def test_a_flood_during_the_surge_only_adds_requests_inside_it() -> None:
    flood = {"count": 4, "flood": {"tenant": "t2", "factor": 5, "during": "surge"}}
    calm = build_schedule(workload(duration_s=60, tenants={"count": 4}))
    flooded = build_schedule(workload(duration_s=60, tenants=flood))
    outside = [p for p in flooded if not 10 <= p.at < 15]
    assert len(outside) == len([p for p in calm if not 10 <= p.at < 15])
    inside = Counter(p.tenant for p in between(flooded, 10, 15))
    # t2 alone: its 1/4 share of 160 req/s for 5 s, times 5 = ~1000 requests
    assert within(inside["t2"], 5 * 160 * 5 / 4)


def test_tenant_settings_are_validated() -> None:
    with pytest.raises(WorkloadError):
        workload(tenants={"count": 2, "flood": {"tenant": "t7", "factor": 5}})
    with pytest.raises(WorkloadError):
        workload(arrival={"kind": "poisson"},
                 tenants={"count": 2, "flood": {"tenant": "t0", "during": "surge"}})
    with pytest.raises(WorkloadError):
        workload(tenants={"count": 0})
    with pytest.raises(WorkloadError):
        workload(tenants={"header": "bad header", "count": 2})
