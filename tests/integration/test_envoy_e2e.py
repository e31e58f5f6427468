"""trimtab end to end: the CLI as a subprocess driving a real Envoy, over SotW and Delta ADS.

Every test runs once per xDS flavour (see ``shared_stack`` in conftest). Timing assertions
count trimtab's ticks (``/readyz`` ``ticks``) where they can, else are derived from the
configured tick (``INTERVAL_S``) plus a small allowance (``SLACK_S``).
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import pytest

from tests.integration.conftest import (
    BASELINE_PCT,
    INTERVAL_S,
    MODELS,
    SETTLE_S,
    SLACK_S,
    STALE_AFTER_S,
    TOTAL_MIB,
    Stack,
    expected_weight,
    http_json,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

SPLIT_REQUESTS = 2000
SPLIT_THREADS = 4
SPLIT_TOLERANCE = 0.03
RESTART_STATS = ("cluster.alpha.update_success", "cluster.beta.update_success",
                 "cluster_manager.cds.update_success", "listener_manager.lds.update_success",
                 "http.trimtab.rds.trimtab-routes.update_success")


def _post(port: int, body: dict[str, Any] | None, headers: dict[str, str] | None = None,
          conn: http.client.HTTPConnection | None = None) -> tuple[int, str, dict[str, Any]]:
    """POST to Envoy's listener; returns (status, content-type, JSON body)."""
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        payload = b"" if body is None else json.dumps(body).encode()
        conn.request("POST", "/v1/chat/completions", body=payload,
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type", ""), json.loads(resp.read())
    finally:
        if own:
            conn.close()


def test_envoy_clusters_show_formula_weights(stack: Stack) -> None:
    pcts = {"alpha": (20.0, 60.0, 100.0), "beta": (0.0, 44.0)}  # -> 90/70/50, 100/78
    for pool, values in pcts.items():
        stack.set_pcts(pool, values)
    for pool, values in pcts.items():
        want = {addr: expected_weight(TOTAL_MIB * pct / 100, TOTAL_MIB)
                for addr, pct in zip(stack.addresses(pool), values, strict=True)}
        assert sorted(want.values(), reverse=True) == (
            [90, 70, 50] if pool == "alpha" else [100, 78])
        stack.wait_envoy(pool, want)
        published = stack.trimtab.weights()["pools"][pool]
        assert {addr: ep["weight"] for addr, ep in published.items()} == want
    names = {c["name"] for c in stack.envoy.clusters_json()["cluster_statuses"]}
    assert {"alpha", "beta"} <= names


def _count_backends(port: int, model: str, requests: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(requests):
            status, _, body = _post(port, {"model": model}, conn=conn)
            assert status == 200, body
            counts[body["backend"]] += 1
    finally:
        conn.close()
    return counts


def test_round_robin_split_follows_weights(stack: Stack) -> None:
    stack.set_pcts("alpha", (0.0, 50.0, 100.0))  # -> 100/75/50: shares 44.4/33.3/22.2 %
    want = stack.expected("alpha")
    stack.wait_envoy("alpha", want)
    per_thread = SPLIT_REQUESTS // SPLIT_THREADS
    with ThreadPoolExecutor(SPLIT_THREADS) as pool:
        parts = list(pool.map(lambda _: _count_backends(stack.listener_port, MODELS["alpha"],
                                                        per_thread), range(SPLIT_THREADS)))
    counts = sum(parts, Counter())
    assert sum(counts.values()) == SPLIT_REQUESTS and set(counts) == set(want)
    total_weight = sum(want.values())
    for address, weight in want.items():
        share, target = counts[address] / SPLIT_REQUESTS, weight / total_weight
        assert abs(share - target) <= SPLIT_TOLERANCE, (address, share, target, dict(counts))


def _wait_envoy_counting_ticks(stack: Stack, pool: str, want: dict[str, int]) -> int:
    """Poll Envoy until ``pool`` shows ``want``; return trimtab's tick count read right after
    Envoy was first seen with it (an upper bound on the count when the change landed). The
    wall-clock timeout is only a safety net; callers assert on the tick count."""
    seen: list[int] = []

    def probe() -> dict[str, int]:
        weights = stack.envoy_weights(pool)
        if weights == want:
            seen.append(stack.trimtab.ticks())
        return weights

    wait_until(probe, SETTLE_S, f"Envoy {pool} weights {want}",
               check=lambda weights: weights == want, every=0.01)
    return seen[0]


def _convergence(stack: Stack) -> tuple[float, float]:
    """(count, sum) of trimtab_convergence_seconds for this stack's xDS flavour."""
    count = stack.trimtab.metric("trimtab_convergence_seconds_count", api=stack.api) or 0.0
    total = stack.trimtab.metric("trimtab_convergence_seconds_sum", api=stack.api) or 0.0
    return count, total


def _counted_more(floor: float, now: tuple[float, float]) -> bool:
    return now[0] > floor


def test_metric_change_reaches_envoy_within_one_tick(stack: Stack) -> None:
    for pool, position, pct in (("alpha", 0, 80.0), ("beta", 1, 4.0)):
        want = {**stack.expected(pool)}
        want[stack.addresses(pool)[position]] = expected_weight(TOTAL_MIB * pct / 100, TOTAL_MIB)
        assert want != stack.envoy_weights(pool)  # a real change
        count_before, sum_before = _convergence(stack)
        stack.set_pct(pool, position, pct)
        # Read just after the change: tick ``done + 1`` is in progress (it may have scraped
        # the old value already), so tick ``done + 2`` reads the new one and must publish it.
        done = stack.trimtab.ticks()
        seen_at_tick = _wait_envoy_counting_ticks(stack, pool, want)
        assert seen_at_tick <= done + 2, (
            f"{pool}: Envoy had the change only at tick {seen_at_tick}; the change was made "
            f"after tick {done}, so it was due by the end of tick {done + 2}")
        # The ACK of that ClusterLoadAssignment completes a convergence observation: the time
        # from the telemetry read to the ACK, at most one tick plus the push allowance.
        count, total = wait_until(lambda: _convergence(stack), INTERVAL_S + SLACK_S,
                                  "trimtab_convergence_seconds observed the ACK",
                                  check=partial(_counted_more, count_before))
        assert count > 0
        mean = (total - sum_before) / (count - count_before)
        assert 0 < mean <= INTERVAL_S + SLACK_S, mean


def test_model_routing_by_body_and_header(stack: Stack) -> None:
    port = stack.listener_port
    alpha, beta = set(stack.addresses("alpha")), set(stack.addresses("beta"))
    status, _, body = _post(port, {"model": MODELS["alpha"]})
    assert status == 200 and body["backend"] in alpha and body["model"] == MODELS["alpha"]
    status, _, body = _post(port, {"model": MODELS["beta"], "messages": []})
    assert status == 200 and body["backend"] in beta
    status, _, body = _post(port, {"model": MODELS["alpha"]}, {"x-model": MODELS["beta"]})
    assert status == 200 and body["backend"] in beta  # the header wins over the body
    status, _, body = _post(port, None, {"x-model": MODELS["alpha"]})
    assert status == 200 and body["backend"] in alpha
    status, _, body = _post(port, {"messages": []})  # two pools: a model must be named
    assert status == 400 and body["error"]["code"] == "model_required"


@pytest.mark.parametrize("body,headers", [
    ({"model": "no/such-model"}, {}),
    ({"model": "example/alpha-8b"}, {"x-model": "no/such-model"}),
], ids=["body", "header"])
def test_unknown_model_gets_404_json(stack: Stack, body: dict[str, Any],
                                     headers: dict[str, str]) -> None:
    status, content_type, answer = _post(stack.listener_port, body, headers)
    assert status == 404
    assert content_type.startswith("application/json")
    assert answer["error"]["code"] == "model_not_found" and answer["error"]["message"]


def _eds_nacks(stack: Stack) -> float:
    return stack.trimtab.metric("trimtab_xds_nacks_total", type="eds") or 0.0


def _change_beta_and_wait(stack: Stack, pcts: list[float]) -> None:
    for pct in pcts:
        stack.set_pct("beta", 0, pct)
        stack.wait_envoy("beta", stack.expected("beta"), timeout=INTERVAL_S + SLACK_S)


def _nack_log(stack: Stack) -> dict[str, Any]:
    status, body = http_json(stack.trimtab.url("/v1/nacks"))
    assert status == 200, body
    return body


def _current_eds_version(stack: Stack, name: str) -> str:
    status, body = http_json(stack.trimtab.url("/v1/snapshot"))
    assert status == 200, body
    return body["current"]["types"]["eds"]["resources"][name]


def test_invalid_resource_is_nacked_and_not_resent(stack: Stack) -> None:
    rejected = "cluster.alpha.update_rejected"
    before_rejected, before_nacks = stack.stat(rejected), _eds_nacks(stack)
    before_logged = _nack_log(stack)["total"]
    good = stack.envoy_weights("alpha")
    stack.trimtab.set_invalid_weight("alpha", True)
    wait_until(lambda: stack.stat(rejected), SETTLE_S, f"{rejected} == {before_rejected + 1}",
               check=lambda value: value == before_rejected + 1)
    wait_until(lambda: _eds_nacks(stack), SETTLE_S, "trimtab counted the NACK",
               check=lambda value: value >= before_nacks + 1)
    log = wait_until(lambda: _nack_log(stack), SETTLE_S, "the NACK in /v1/nacks",
                     check=lambda doc: doc["total"] == before_logged + 1)
    record = log["recent"][0]  # newest first
    assert (record["node"], record["api"], record["type"]) == ("envoy-local", stack.api, "eds")
    assert record["rejected"]["alpha"] == _current_eds_version(stack, "alpha")  # the broken one
    assert record["nonce"] and record["detail"].strip(), record
    nacks = _eds_nacks(stack)
    ticks = stack.trimtab.ticks()
    _change_beta_and_wait(stack, [5.0, 35.0, 65.0])  # other pools keep updating
    stack.trimtab.wait_ticks(3, since=ticks)
    assert stack.stat(rejected) == before_rejected + 1  # never re-sent, so never re-rejected
    assert _eds_nacks(stack) == nacks
    assert stack.envoy_weights("alpha") == good  # Envoy kept the last good assignment
    stack.trimtab.set_invalid_weight("alpha", False)
    stack.set_pct("alpha", 2, 40.0)
    stack.wait_envoy("alpha", stack.expected("alpha"), timeout=INTERVAL_S + SLACK_S)
    assert stack.stat(rejected) == before_rejected + 1


def _reconnected(stack: Stack) -> bool:
    streams = stack.trimtab.metric("trimtab_xds_streams", api=stack.api)
    return streams == 1 and stack.envoy.stat("control_plane.connected_state") == 1


def test_restart_with_same_inputs_pushes_nothing_new(stack: Stack) -> None:
    stack.trimtab.wait_ticks(2)  # settled: nothing changes between ticks
    before = {name: stack.stat(name) for name in RESTART_STATS}
    weights = {pool: stack.envoy_weights(pool) for pool in BASELINE_PCT}
    assert all(before.values()), before  # the counters exist and were used
    assert stack.trimtab.stop(signal.SIGTERM) == 0
    stack.trimtab.start()
    stack.trimtab.wait_ready()
    wait_until(lambda: _reconnected(stack), SETTLE_S, "Envoy reconnected to the new trimtab")
    stack.trimtab.wait_ticks(2)
    assert {name: stack.stat(name) for name in RESTART_STATS} == before
    assert {pool: stack.envoy_weights(pool) for pool in BASELINE_PCT} == weights


def _endpoint(stack: Stack, pool: str, position: int) -> dict[str, Any]:
    return stack.trimtab.weights()["pools"][pool][stack.addresses(pool)[position]]


def test_malformed_metrics_make_only_that_endpoint_stale(stack: Stack) -> None:
    bad = stack.addresses("alpha")[1]
    healthy = {pool: stack.expected(pool) for pool in BASELINE_PCT}
    broken_at = time.monotonic()
    stack.fleet.set_metrics_mode(stack.members["alpha"][1], "garbage")
    document = wait_until(stack.trimtab.weights, INTERVAL_S + SLACK_S, f"{bad} stale in /v1/weights",
                          check=lambda doc: doc["pools"]["alpha"][bad]["stale"])
    assert document["pools"]["alpha"][bad]["weight"] == healthy["alpha"][bad]  # held until stale_after
    for pool, want in healthy.items():
        for address, endpoint in document["pools"][pool].items():
            if address != bad:
                assert not endpoint["stale"] and endpoint["weight"] == want[address], address
    assert document["fail_static_pools"] == []
    last_good = document["pools"]["alpha"][bad]["updated_at"]  # unix time of the last good sample
    remaining = STALE_AFTER_S + INTERVAL_S + SLACK_S - (time.monotonic() - broken_at)
    stack.wait_envoy("alpha", {**healthy["alpha"], bad: 1}, timeout=remaining)
    assert time.time() - last_good >= STALE_AFTER_S  # weight 1 only once the sample is too old
    assert stack.envoy_weights("beta") == healthy["beta"]
    assert _endpoint(stack, "alpha", 1)["saturated"] is True


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_shuts_down_gracefully(stack: Stack, sig: signal.Signals) -> None:
    # An xDS stream is open while it shuts down. The fixture may have just restarted trimtab
    # (the previous case stopped it), and Envoy redials on its own backoff: wait for it.
    wait_until(lambda: _reconnected(stack), SETTLE_S, "Envoy connected to trimtab")
    started = time.monotonic()
    assert stack.trimtab.stop(sig, timeout=5.0) == 0  # not killed, exit status 0
    assert time.monotonic() - started < 5.0
    assert _port_closed(stack.trimtab.admin_port) and _port_closed(stack.xds_port)
    wait_until(lambda: stack.envoy.stat("control_plane.connected_state"), SETTLE_S,
               "Envoy noticed the control plane left", check=lambda state: state == 0)
