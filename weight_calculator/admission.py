"""Admission budgets: how many requests a pool may hold in flight so that a new one still
starts within its TTFT SLO. Pure: weights, policy and the previous budget in, a budget out.

Per endpoint the queueing policy measures the service rate ``mu`` (work/s, at capacity), the
mean work per request ``c`` and the requests running and waiting. The endpoint completes
``mu / c`` requests a second, so a request queued behind ``k`` others starts after about
``k * c / mu`` seconds. The budget is what it runs at once plus the queue that still starts
within ``wait_fraction`` of the SLO (the rest of the SLO covers the request's own prefill and
the tick's lag)::

    budget_i = R_i + floor(wait_fraction * ttft_seconds * mu_i / c)

``R_i``, the requests the engine runs at once, is the most it has been seen running, drifting
down slowly (a tenth of the gap a read) only while reads find it full (requests waiting) with
fewer running: a long prefill holds an engine full with a few requests for a moment, which
says little of what it runs at once. The pool's budget is the sum over its serving endpoints, never below what they run
at once, so admission never refuses work the fleet can serve. A pool with a serving endpoint
whose service rate is not measured yet has no budget: it admits everything (what an engine
runs now says nothing of what it could; a throughput seen below saturation only bounds its
rate from below, and budgets from it refused steady load while the engines warmed up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from weight_calculator.health import DEGRADED, HEALTHY
from weight_calculator.types import EndpointWeight, PoolWeights

RUNNING_CAPACITY = "admission.running_capacity"  # breakdown-style key of what is carried
_LOWER = 0.1  # how far a full read running fewer moves R down (a long prefill holds an engine
# full with few running: one such read must not shrink it)


@dataclass(frozen=True)
class AdmissionPolicy:
    """``ttft_seconds``: the pool's SLO on time to first token. ``wait_fraction``: the share
    of it a request may spend queued."""

    ttft_seconds: float
    wait_fraction: float = 0.75

    def __post_init__(self) -> None:
        if self.ttft_seconds <= 0:
            raise ValueError(f"ttft_seconds must be > 0, got {self.ttft_seconds}")
        if not 0 < self.wait_fraction <= 1:
            raise ValueError(f"wait_fraction must be in (0, 1], got {self.wait_fraction}")


@dataclass(frozen=True)
class EndpointBudget:
    running_capacity: float  # R: what the engine runs at once (learnt)
    queue: int  # requests that may wait and still start within the SLO (0 unmeasured)
    measured: bool  # a service rate and a work per request were known
    completions: float = 0.0  # requests finished per second at capacity (mu / c)


@dataclass(frozen=True)
class PoolBudget:
    """``in_flight``: the pool's budget (requests in flight across every Envoy), None when
    nothing is measured yet (admit everything). ``serving``: what the endpoints run at once
    (the floor); ``held``: what they run and queue now; ``rate``: their completions a
    second (fairness and spill steer by these). ``retry_after_s``: when a refused request
    may expect room: the time the pool needs to finish what it holds beyond the budget, and
    one more."""

    in_flight: int | None
    serving: int
    retry_after_s: float
    endpoints: Mapping[str, EndpointBudget] = field(default_factory=dict)
    reason: str = ""
    held: float = 0.0  # requests the serving endpoints run and queue now (this tick's read)
    rate: float = 0.0  # requests the measured serving endpoints finish per second


def _running_capacity(ew: EndpointWeight, previous: EndpointBudget | None) -> float:
    running = ew.signals.get("running", 0.0)
    waiting = ew.signals.get("queue", 0.0)
    before = previous.running_capacity if previous is not None else 0.0
    if waiting > 0 and running > 0 and running < before:  # full with fewer: drift down
        return before - _LOWER * (before - running)
    return max(before, running)


def _endpoint_budget(ew: EndpointWeight, policy: AdmissionPolicy,
                     previous: EndpointBudget | None) -> EndpointBudget:
    r = _running_capacity(ew, previous)
    mu = ew.breakdown.get("service_rate_used")
    c = ew.breakdown.get("work_per_request")
    if not mu or not c or mu <= 0 or c <= 0:
        return EndpointBudget(r, 0, False)
    queue = math.floor(policy.wait_fraction * policy.ttft_seconds * mu / c)
    return EndpointBudget(r, max(0, queue), True, mu / c)


def _serves(ew: EndpointWeight) -> bool:
    """Endpoints Envoy sends new requests to: healthy (standby is priority 1, failover only;
    degraded hosts take only what spills)."""
    return ew.health in (HEALTHY, DEGRADED)


def pool_budget(weights: PoolWeights, policy: AdmissionPolicy,
                previous: PoolBudget | None = None) -> PoolBudget:
    """The pool's admission budget from this tick's weights. Never raises."""
    before = previous.endpoints if previous is not None else {}
    endpoints = {a: _endpoint_budget(ew, policy, before.get(a))
                 for a, ew in weights.endpoints.items()}
    serving_set = [a for a, ew in weights.endpoints.items() if _serves(ew)]
    measured = [a for a in serving_set if endpoints[a].measured]
    serving = math.ceil(sum(endpoints[a].running_capacity for a in serving_set))
    unknown = len(serving_set) - len(measured)
    if not measured or unknown or weights.fail_static:
        why = ("fail-static" if weights.fail_static
               else "no service rate measured yet" if not measured
               else f"the service rate of {unknown} serving endpoint(s) is not measured yet")
        return PoolBudget(None, serving, 0.0, endpoints, f"admit everything: {why}")
    queue = sum(endpoints[a].queue for a in measured)
    total = max(serving, serving + queue, 1)
    held = sum(ew.signals.get("running", 0.0) + ew.signals.get("queue", 0.0)
               for a, ew in weights.endpoints.items() if a in serving_set)
    rate = sum(endpoints[a].completions for a in measured)
    retry_after = (max(0.0, held - total) + 1.0) / rate
    return PoolBudget(total, serving, retry_after, endpoints,
                      f"{serving} running + {queue} queued within "
                      f"{policy.wait_fraction:g} x {policy.ttft_seconds:g}s", held, rate)


def per_envoy(budget: int, envoys: int) -> int:
    """One Envoy's part of a pool budget when ``envoys`` share it (each counts only its own
    requests in flight), rounded up so the parts never sum below the budget."""
    return max(1, math.ceil(budget / max(1, envoys)))
