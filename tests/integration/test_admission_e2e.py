"""Admission end to end: measured capacity in, Envoy's circuit breakers (over RTDS) out.

Two fake vLLM servers behind ``trimtab serve`` with ``slo.ttft_seconds`` and a real Envoy.
Each page says the engine is full (requests waiting) and finishes 2 requests a second (work
counters at 2,000 tokens/s, 1,000 tokens a request) with 8 running. The budget is then, by
weight_calculator/admission.py's formula (docs/configuration.md, "Admission"):
8 running + floor(0.75 x 2 s x 2/s) = 3 queued, per server: 22 for the pool, batch half of
it. The servers hold every request for seconds, so a burst over the budget is refused at
once with an OpenAI-shaped 429 and ``Retry-After``, and a budget change reaches Envoy as a
runtime update, never as a cluster update. Envoy's load reports (LRS) tell trimtab what it
admitted (issued) and refused (dropped), and those counts match Envoy's own stats.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
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

pytestmark = pytest.mark.slow

INTERVAL_S = 0.5
SETTLE_S = 20.0
MODEL = "m-admission"
HOLD_S = 3.0  # how long a server holds each request
BUDGET, BATCH = 22, 11


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    page = VllmPage(kv_usage=0.9, waiting=4, running=8, tokens_per_s=2000.0,
                    tokens_per_request=1000.0)
    pool = {"name": "adm", "model": MODEL, "slo": {"ttft_seconds": 2.0}}
    with admission_stack(tmp_path_factory.mktemp("admission"), [page, page], HOLD_S, pool,
                         INTERVAL_S, SETTLE_S) as stack:
        yield stack


def _burst(port: int, count: int, priority: str | None) -> list[Reply]:
    return burst(port, MODEL, [{"x-priority": priority} if priority else None] * count)


def test_a_burst_over_the_budget_is_refused_at_once_with_an_openai_429(stack) -> None:
    fleet, trimtab, envoy, port = stack
    key = "circuit_breakers.adm.high.max_requests"
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S * 2, f"Envoy's runtime holds {key}={BUDGET}",
               check=lambda rt: rt.get(key) == str(BUDGET)
               and rt.get("circuit_breakers.adm.default.max_requests") == str(BATCH))
    before = envoy_counters(envoy)
    results = _burst(port, 30, None)
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(served) == BUDGET and len(refused) == 30 - BUDGET, [r[0] for r in results]
    for _status, seconds, headers, body in refused:
        assert seconds < 1.0, seconds  # answered by Envoy, never queued behind the servers
        error = json.loads(body)["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] and error["message"]
        assert int(headers["retry-after"]) >= 1
    after = envoy_counters(envoy)
    assert after["cluster.adm.upstream_rq_active_overflow"] - before.get(
        "cluster.adm.upstream_rq_active_overflow", 0) == len(refused)


def _lrs_counts(trimtab: TrimtabProcess) -> tuple[int, int]:
    """trimtab's (issued, dropped) for the pool, from Envoy's load reports."""
    return tuple(int(trimtab.metric("trimtab_envoy_requests_total", cluster="adm",
                                    outcome=outcome) or 0)
                 for outcome in ("issued", "dropped"))  # type: ignore[return-value]


def _envoy_counts(envoy: EnvoyProcess) -> tuple[int, int]:
    """Envoy's own (admitted, refused by the circuit breaker) for the pool."""
    stats = envoy_counters(envoy)
    return (stats.get("cluster.adm.upstream_rq_total", 0),
            stats.get("cluster.adm.upstream_rq_active_overflow", 0))


def _settled(trimtab: TrimtabProcess):
    """A check: trimtab's LRS sums did not move over three report intervals."""
    def check(counts: tuple[tuple[int, int], tuple[int, int]]) -> bool:
        time.sleep(INTERVAL_S * 3)
        return _lrs_counts(trimtab) == counts[0]
    return check


def _admission(trimtab: TrimtabProcess) -> dict:
    with urllib.request.urlopen(trimtab.url("/v1/admission"), timeout=5) as resp:
        return json.loads(resp.read())["pools"]["adm"]["clusters"]["adm"]


def test_trimtab_counts_what_envoy_admitted_and_refused_from_its_load_reports(stack) -> None:
    fleet, trimtab, envoy, port = stack
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S, "the budget in force",
               check=lambda rt: rt.get("circuit_breakers.adm.high.max_requests") == str(BUDGET))
    wait_until(lambda: envoy_counters(envoy).get("cluster.adm.upstream_rq_active", 0), HOLD_S * 3,
               "earlier requests finished", check=lambda active: active == 0)
    # Envoy reports a cluster's counts from when the cluster enters its report (requests
    # before that are never reported): compare what this burst adds, once the sums are still
    before = wait_until(lambda: (_lrs_counts(trimtab), _envoy_counts(envoy)), SETTLE_S,
                        "no report still to come", check=_settled(trimtab))
    lrs_before, before = before
    in_flight: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            in_flight.append(int(trimtab.metric("trimtab_envoy_requests_in_progress",
                                                cluster="adm") or 0))
            time.sleep(0.1)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = _burst(port, 30, None)
    finally:
        done.set()
        watcher.join()
    served = sum(r[0] == 200 for r in results)
    refused = sum(r[0] == 429 for r in results)
    assert served == BUDGET and refused == 30 - BUDGET, [r[0] for r in results]
    after = _envoy_counts(envoy)
    assert (after[0] - before[0], after[1] - before[1]) == (served, refused)  # Envoy's view
    counted = wait_until(lambda: _lrs_counts(trimtab), SETTLE_S, "the burst in LRS",
                         check=lambda c: (c[0] - lrs_before[0], c[1] - lrs_before[1])
                         == (served, refused))
    time.sleep(INTERVAL_S * 3)  # and nothing more comes: exactly the burst, no double count
    assert _lrs_counts(trimtab) == counted
    assert max(in_flight) == served, in_flight  # the level, while the servers held them
    document = _admission(trimtab)
    assert document["budget"] == BUDGET and document["limit"] == {"interactive": BUDGET,
                                                                  "batch": BATCH}
    assert (document["envoy"]["issued"], document["envoy"]["dropped"]) == counted


def test_batch_is_refused_first(stack) -> None:
    fleet, trimtab, envoy, port = stack
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S, "the budget in force",
               check=lambda rt: rt.get("circuit_breakers.adm.default.max_requests") == str(BATCH))
    results = _burst(port, 20, "batch")
    assert sum(r[0] == 200 for r in results) == BATCH, [r[0] for r in results]
    assert sum(r[0] == 429 for r in results) == 20 - BATCH


def test_a_budget_change_is_a_runtime_update_not_a_cluster_update(stack) -> None:
    fleet, trimtab, envoy, port = stack
    before = envoy_counters(envoy)
    for index in range(2):  # twice as fast: 4 requests/s each, 6 may queue: 28 in all
        fleet.set_vllm(index, tokens_per_s=4000.0)
    key = "circuit_breakers.adm.high.max_requests"
    wait_until(lambda: envoy_runtime(envoy), SETTLE_S * 3, "the budget grows",
               check=lambda rt: int(rt.get(key) or 0) > BUDGET)
    after = envoy_counters(envoy)
    assert after["runtime.load_success"] > before["runtime.load_success"]
    for name in ("cluster_manager.cds.update_success", "cluster_manager.cluster_modified",
                 "cluster_manager.cluster_added", "cluster_manager.cluster_removed"):
        assert after.get(name, 0) == before.get(name, 0), name


def test_the_budget_in_force_is_on_trimtabs_metrics(stack) -> None:
    fleet, trimtab, envoy, port = stack
    batch = wait_until(lambda: trimtab.metric("trimtab_admission_limit", cluster="adm",
                                              priority="batch"),
                       SETTLE_S, "the admission gauges", check=lambda v: v is not None)
    interactive = trimtab.metric("trimtab_admission_limit", cluster="adm",
                                 priority="interactive")
    assert interactive is not None and batch is not None and 0 < batch < interactive
    assert trimtab.metric("trimtab_admission_envoys", cluster="adm") == 1.0
