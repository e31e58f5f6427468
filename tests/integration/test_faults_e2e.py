"""Faults with traffic flowing: Envoy keeps serving on its last good config.

Each test runs once per xDS flavour on the shared stack (see ``shared_stack`` in conftest) while
a thread sends ~50 requests per second through Envoy's listener and records every answer:

* the control plane is SIGKILLed and restarted: not one request fails, requests keep flowing
  during the outage, and Envoy reconnects to the new process with the same weights;
* every endpoint of a pool loses its telemetry (garbage, HTTP 500 and a hanging metrics page,
  while the model servers still answer requests): trimtab reports the pool fail-static and
  holds its last weights, Envoy keeps them, traffic is unaffected, and the pool recovers as
  soon as telemetry is back.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.integration.conftest import (
    BASELINE_PCT,
    INTERVAL_S,
    MODELS,
    SETTLE_S,
    SLACK_S,
    STALE_AFTER_S,
    Stack,
    http_json,
)
from tests.support import MetricsMode
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow

RATE_RPS = 50.0
WARM_REQUESTS = 50  # ~1 s of traffic before the fault
OUTAGE_S = 0.5  # the control plane stays dead this long, plus its restart time
AFTER_S = 1.0  # traffic after recovery
MIN_OUTAGE_SHARE = 0.5  # of the requests the rate promises during the outage
NODE_ID = "envoy-local"  # render_bootstrap's default node id


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic, when the answer (or the error) came back
    status: int  # HTTP status; 0 for a transport error
    backend: str | None
    error: str | None = None


@dataclass
class Traffic:
    """POSTs for one model at a steady rate through Envoy, in a thread; every answer recorded."""

    port: int
    model: str
    rate: float = RATE_RPS
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "traffic thread did not stop"

    def _one(self, conn: http.client.HTTPConnection) -> Sample:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"model": self.model}),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        try:
            backend = json.loads(body).get("backend")
        except ValueError:
            backend = None
        return Sample(time.monotonic(), resp.status, backend,
                      None if resp.status == 200 else body[:200].decode(errors="replace"))

    def _run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        next_at = time.monotonic()
        while not self._stop.is_set():
            conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                sample = self._one(conn)
            except (OSError, http.client.HTTPException) as exc:
                sample = Sample(time.monotonic(), 0, None, repr(exc))
                conn.close()
                conn = None
            with self._lock:
                self.samples.append(sample)
            next_at = max(next_at + 1.0 / self.rate, time.monotonic() - 1.0 / self.rate)
            self._stop.wait(max(0.0, next_at - time.monotonic()))
        if conn is not None:
            conn.close()

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def count(self) -> int:
        with self._lock:
            return len(self.samples)

    def wait_count(self, extra: int) -> None:
        target = self.count() + extra
        wait_until(self.count, extra / self.rate + SETTLE_S, f"{target} requests sent",
                   check=lambda n: n >= target)


def _failures(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.status != 200]


def _between(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.at <= end]


def _connected(stack: Stack) -> int | None:
    return stack.envoy.stat("control_plane.connected_state")


def _envoy_stream(stack: Stack) -> dict[str, Any] | None:
    """Envoy's stream in the (new) trimtab's /v1/snapshot, once it subscribed to every type.
    (Delta resumes with the versions it holds, so an unchanged snapshot sends nothing.)"""
    try:
        status, body = http_json(stack.trimtab.url("/v1/snapshot"), timeout=1.0)
    except OSError:
        return None
    if status != 200:
        return None
    for stream in body["streams"]:
        if stream["node"] == NODE_ID and set(stream["types"]) >= {"cds", "eds", "lds", "rds"}:
            return stream
    return None


def test_sigkill_of_the_control_plane_fails_no_request(stack: Stack) -> None:
    weights = {pool: stack.envoy_weights(pool) for pool in BASELINE_PCT}
    with Traffic(stack.listener_port, MODELS["alpha"]) as traffic:
        traffic.wait_count(WARM_REQUESTS)
        killed_at = time.monotonic()
        assert stack.trimtab.stop(signal.SIGKILL) == -signal.SIGKILL
        wait_until(lambda: _connected(stack), SETTLE_S, "Envoy saw the control plane go",
                   check=lambda state: state == 0)
        time.sleep(OUTAGE_S)
        assert {pool: stack.envoy_weights(pool) for pool in BASELINE_PCT} == weights
        restart_at = time.monotonic()
        stack.trimtab.start()
        stack.trimtab.wait_ready()
        stream = wait_until(lambda: _envoy_stream(stack), SETTLE_S,
                            "Envoy's stream (EDS ACKed) in the new trimtab's /v1/snapshot")
        wait_until(lambda: _connected(stack), SETTLE_S, "Envoy connected again",
                   check=lambda state: state == 1)
        reconnected_at = time.monotonic()
        traffic.wait_count(round(AFTER_S * RATE_RPS))
    samples = traffic.snapshot()
    assert stream is not None and stream["api"] == stack.api
    assert not _failures(samples), _failures(samples)[:5]
    outage = _between(samples, killed_at, reconnected_at)
    expected = (reconnected_at - killed_at) * RATE_RPS
    assert len(outage) >= MIN_OUTAGE_SHARE * expected, (len(outage), expected)
    assert _between(samples, killed_at + OUTAGE_S / 2, restart_at), "no request while it was down"
    assert {s.backend for s in outage} == set(stack.addresses("alpha"))
    assert len(_between(samples, reconnected_at, time.monotonic())) >= AFTER_S * RATE_RPS
    assert {pool: stack.envoy_weights(pool) for pool in BASELINE_PCT} == weights


def _alpha_all_stale(document: dict[str, Any]) -> bool:
    return all(ep["stale"] for ep in document["pools"]["alpha"].values())


def test_pool_without_telemetry_is_fail_static_and_envoy_keeps_its_weights(stack: Stack) -> None:
    stack.set_pcts("alpha", (20.0, 60.0, 100.0))  # -> 90/70/50, not the baseline
    held = stack.expected("alpha")
    stack.wait_envoy("alpha", held)
    beta = stack.envoy_weights("beta")
    fail_static_within = STALE_AFTER_S + 2 * INTERVAL_S + SLACK_S
    with Traffic(stack.listener_port, MODELS["alpha"]) as traffic:
        traffic.wait_count(WARM_REQUESTS // 2)
        # Lose every page at a random instant of the tick: endpoints read before it in that
        # tick lose telemetry one tick later than the others, and none may drop to weight 1.
        time.sleep(random.uniform(0.0, INTERVAL_S))
        lost_at = time.monotonic()
        modes: tuple[MetricsMode, ...] = ("garbage", "error", "hang")
        for index, mode in zip(stack.members["alpha"], modes, strict=True):
            stack.fleet.set_metrics_mode(index, mode)
        weights_seen: list[dict[str, int]] = []

        def alpha_stale(doc: dict[str, Any]) -> bool:
            weights_seen.append({a: ep["weight"] for a, ep in doc["pools"]["alpha"].items()})
            return _alpha_all_stale(doc)

        wait_until(stack.trimtab.weights, 2 * INTERVAL_S + SLACK_S,
                   "every alpha endpoint stale", check=alpha_stale)
        stack.set_pcts("alpha", (90.0, 90.0, 90.0))  # a change trimtab cannot see now
        # every read of the pool fails: fail-static at once, long before stale_after
        document = wait_until(stack.trimtab.weights, 2 * INTERVAL_S + SLACK_S, "alpha fail-static",
                              check=lambda doc: doc["fail_static_pools"] == ["alpha"])
        static_at = time.monotonic()
        assert all(seen == held for seen in weights_seen), weights_seen
        for address, endpoint in document["pools"]["alpha"].items():
            assert endpoint["weight"] == held[address], (address, endpoint)
            assert endpoint["stale"] and "fail-static" in endpoint["reason"], endpoint
        # and it holds well past stale_after, the weights from before the loss included
        time.sleep(max(0.0, lost_at + fail_static_within - time.monotonic()))
        assert stack.trimtab.weights()["fail_static_pools"] == ["alpha"]
        assert stack.envoy_weights("alpha") == held
        assert stack.trimtab.metric("trimtab_pool_fail_static", pool="alpha") == 1.0
        assert stack.trimtab.metric("trimtab_pool_fail_static", pool="beta") == 0.0
        stack.trimtab.wait_ticks(3)
        assert stack.trimtab.weights()["fail_static_pools"] == ["alpha"]
        assert stack.envoy_weights("alpha") == held  # the last weights, not 1s
        assert stack.envoy_weights("beta") == beta
        traffic.wait_count(round(INTERVAL_S * RATE_RPS))
        held_until = time.monotonic()
    samples = traffic.snapshot()
    assert not _failures(samples), _failures(samples)[:5]
    during = _between(samples, static_at, held_until)
    assert len(during) >= MIN_OUTAGE_SHARE * (held_until - static_at) * RATE_RPS, len(during)
    assert {s.backend for s in during} == set(held)  # every endpoint kept its share
    for index in stack.members["alpha"]:
        stack.fleet.set_metrics_mode(index, "ok")
    stack.wait_envoy("alpha", stack.expected("alpha"), timeout=2 * INTERVAL_S + SLACK_S)
    assert stack.trimtab.weights()["fail_static_pools"] == []
    assert stack.trimtab.metric("trimtab_pool_fail_static", pool="alpha") == 0.0
