"""Tenant fairness end to end: a real Envoy keeps a token bucket per ``x-tenant`` value and
refuses over it only while trimtab says the pool is pressed.

Two fake vLLM servers behind ``trimtab serve`` (``slo.ttft_seconds: 2``, ``tenant_header:
x-tenant``). First each page says the engine is full with a long queue (8 running, 12
waiting, 2 requests a second: budget 22, more than half of its queue held), so the pool is
pressed every tick: the tenant cap falls to its floor (1/64 request a second, a bucket of
one token) and is enforced. A tenant's burst then gets one request through and a 429 for
the rest, while another tenant, and the tenants without the header (one shared bucket), each
still get theirs. Then the pages go quiet: the cap climbs back, enforcement is switched off
over RTDS, and the same burst is served whole although its bucket runs dry (Envoy counts,
does not refuse).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.conftest import TrimtabProcess
from tests.support import VllmPage
from tests.support.admission import (
    Reply,
    Stack,
    admission_stack,
    burst,
    envoy_counters,
    envoy_runtime,
)
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess
from weight_calculator.fairness import MIN_LEVEL, rate_of

pytestmark = pytest.mark.slow

INTERVAL_S = 0.5
SETTLE_S = 20.0
MODEL = "m-tenants"
HOLD_S = 2.0  # how long a server holds each request
ENFORCED = "trimtab.tenants.fair.enforced"
STATS = "trimtab_tenants_fair.http_local_rate_limit"


def _page(running: int, waiting: int) -> VllmPage:
    return VllmPage(kv_usage=0.9, waiting=waiting, running=running, tokens_per_s=2000.0,
                    tokens_per_request=1000.0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    pool = {"name": "fair", "model": MODEL, "slo": {"ttft_seconds": 2.0},
            "admission": {"tenant_header": "x-tenant"}}
    page = _page(running=8, waiting=12)
    with admission_stack(tmp_path_factory.mktemp("tenants"), [page, page], HOLD_S, pool,
                         INTERVAL_S, SETTLE_S) as stack:
        yield stack


def _burst(port: int, tenants: list[str | None]) -> list[Reply]:
    return burst(port, MODEL, [{"x-tenant": t} if t is not None else None for t in tenants])


def _codes(results: list[Reply]) -> list[int]:
    return [r[0] for r in results]


def _cap_at_floor(trimtab: TrimtabProcess, envoy: EnvoyProcess) -> None:
    """Enforced, the cap at its floor (no more route changes), and Envoy holding both."""
    floor = rate_of(MIN_LEVEL)
    wait_until(lambda: trimtab.metric("trimtab_admission_tenant_rate", cluster="fair"),
               SETTLE_S * 2, "the tenant cap at its floor",
               check=lambda v: v is not None and abs(v - floor) < 1e-9)
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S, f"Envoy's runtime holds {ENFORCED}=100",
               check=lambda rt: rt.get(ENFORCED) == "100")
    wait_until(lambda: envoy.admin_get("/config_dump?resource=dynamic_route_configs"),
               SETTLE_S, "Envoy's routes hold the floor's bucket (64 s a token)",
               check=lambda dump: '"fill_interval": "64s"' in dump)


def test_a_flooding_tenant_is_refused_past_its_bucket_and_the_others_still_pass(stack) -> None:
    fleet, trimtab, envoy, port = stack
    _cap_at_floor(trimtab, envoy)
    before = envoy_counters(envoy)
    flood = _burst(port, ["flood"] * 8)
    assert sorted(_codes(flood)) == [200] + [429] * 7, _codes(flood)  # a bucket of one
    for status, seconds, headers, body in flood:
        if status != 429:
            continue
        assert seconds < 1.0, seconds  # Envoy answers at once, nothing queued
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert "share" in error["message"]  # the tenant limit's reply, not the budget's
        assert int(headers["retry-after"]) >= 1
    others = _burst(port, ["calm", "quiet", None])
    assert _codes(others) == [200, 200, 200]  # each its own bucket; no header: one shared
    assert _codes(_burst(port, [None])) == [429]  # the anonymous bucket is spent too
    after = envoy_counters(envoy)
    for stat in ("rate_limited", "enforced"):  # found the bucket empty; refused for it
        assert after[f"{STATS}.{stat}"] - before.get(f"{STATS}.{stat}", 0) == 8, stat
    assert after.get("cluster.fair.upstream_rq_active_overflow", 0) == before.get(
        "cluster.fair.upstream_rq_active_overflow", 0)  # none of it was the budget's breaker


def test_with_room_in_the_pool_the_tenant_limit_only_counts(stack) -> None:
    fleet, trimtab, envoy, port = stack
    for index in range(2):
        fleet.set_vllm(index, _page(running=2, waiting=0))
    wait_until(lambda: trimtab.metric("trimtab_admission_tenant_enforced", cluster="fair"),
               SETTLE_S * 3, "the tenant limit switched off", check=lambda v: v == 0.0)
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S, f"{ENFORCED} gone from Envoy's runtime",
               check=lambda rt: ENFORCED not in rt or rt[ENFORCED] in ("", "0"))
    before = envoy_counters(envoy)
    flood = _burst(port, ["flood"] * 12)  # the cap back at 4 a second, a bucket of 4: runs dry
    assert _codes(flood) == [200] * 12
    after = envoy_counters(envoy)
    assert after[f"{STATS}.rate_limited"] > before.get(f"{STATS}.rate_limited", 0)
    assert after.get(f"{STATS}.enforced", 0) == before.get(f"{STATS}.enforced", 0)
