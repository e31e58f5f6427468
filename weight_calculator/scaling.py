"""The dual-metric autoscaler: pure functions, no clocks, no I/O.

Every tick the caller computes one *score* per pool and asks for a decision::

    score = 0.6 × (p95_latency / latency_slo) + 0.4 × (mem_used / mem_total)

``mem_used / mem_total`` is the KV-cache use where the server reports it (else GPU memory),
a fraction in [0, 1]. The latency term is *not* capped at 1: a pool at 2× its SLO scores 1.2
from latency alone, which is what should drive a scale-up.

Missing inputs (``None``, NaN or infinite) are handled by **renormalising over the terms
that are present**, so the score keeps the same 0..1-ish scale and the thresholds keep their
meaning:

* both present        -> ``0.6·L + 0.4·M``
* latency missing     -> ``M``  (= ``0.4·M / 0.4``)
* memory missing      -> ``L``  (= ``0.6·L / 0.6``)
* both missing        -> no score; the decision holds the replica count ("no telemetry").

Decision (`decide`): above ``scale_up_threshold`` (0.8) add ``scale_up_step`` replicas, below
``scale_down_threshold`` (0.3) remove ``scale_down_step``; always within
``[min_replicas, max_replicas]``. Cooldowns are measured from the *last scale event of either
direction*: a scale-up needs ``scale_up_cooldown_seconds`` (60 s) since it, a scale-down needs
``scale_down_cooldown_seconds`` (120 s). So two scale events are never closer than the
cooldown of the second one, and a scale-down never follows a scale-up within 120 s (no
flapping). A replica count outside the bounds (the policy changed) is clamped at once, cooldown
or not, and that clamp counts as a scale event.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

Direction = Literal["up", "down"]


@dataclass(frozen=True)
class ScalingInputs:
    """One pool's telemetry for one tick. ``None`` (or NaN/inf) means "not available"."""

    p95_latency_seconds: float | None = None
    memory_used_fraction: float | None = None  # KV-cache (or GPU memory) use, 0..1


@dataclass(frozen=True)
class ScalingPolicy:
    """Knobs of the autoscaler; defaults are the seed's."""

    latency_slo_seconds: float = 1.0
    min_replicas: int = 1
    max_replicas: int = 10
    latency_weight: float = 0.6
    memory_weight: float = 0.4
    scale_up_threshold: float = 0.8
    scale_down_threshold: float = 0.3
    scale_up_cooldown_seconds: float = 60.0
    scale_down_cooldown_seconds: float = 120.0
    scale_up_step: int = 1
    scale_down_step: int = 1

    def __post_init__(self) -> None:
        problems = _policy_problems(self)
        if problems:
            raise ValueError("; ".join(problems))


def _policy_problems(p: ScalingPolicy) -> list[str]:
    checks = [
        (math.isfinite(p.latency_slo_seconds) and p.latency_slo_seconds > 0,
         f"latency_slo_seconds must be > 0, got {p.latency_slo_seconds!r}"),
        (0 <= p.min_replicas <= p.max_replicas,
         f"need 0 <= min_replicas <= max_replicas, got {p.min_replicas}..{p.max_replicas}"),
        (_finite_nonneg(p.latency_weight) and _finite_nonneg(p.memory_weight)
         and p.latency_weight + p.memory_weight > 0,
         "latency_weight and memory_weight must be >= 0 and not both 0"),
        (math.isfinite(p.scale_up_threshold) and math.isfinite(p.scale_down_threshold)
         and p.scale_down_threshold < p.scale_up_threshold,
         f"need scale_down_threshold < scale_up_threshold, got "
         f"{p.scale_down_threshold!r} and {p.scale_up_threshold!r}"),
        (_finite_nonneg(p.scale_up_cooldown_seconds)
         and _finite_nonneg(p.scale_down_cooldown_seconds), "cooldowns must be finite and >= 0"),
        (p.scale_up_step >= 1 and p.scale_down_step >= 1, "scale steps must be >= 1"),
    ]
    return [message for ok, message in checks if not ok]


def _finite_nonneg(value: float) -> bool:
    return math.isfinite(value) and value >= 0


@dataclass(frozen=True)
class ScalingState:
    """What the autoscaler remembers about one pool between ticks."""

    replicas: int  # the replica count it last asked for
    last_scale_at: float | None = None  # `now` of the last scale event, None if never
    last_direction: Direction | None = None
    score: float | None = None  # the latest score (for metrics/admin; not used to decide)


class ScalingDecision(NamedTuple):
    """``(new_state, desired_replicas, reason)``; unpacks as a plain 3-tuple."""

    state: ScalingState
    desired_replicas: int
    reason: str


def initial_state(policy: ScalingPolicy, replicas: int | None = None) -> ScalingState:
    """A fresh state at ``replicas`` (default ``min_replicas``), clamped, with no cooldown."""
    start = policy.min_replicas if replicas is None else replicas
    return ScalingState(replicas=_clamp(start, policy))


def _usable(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return max(0.0, float(value))


def compute_score(inputs: ScalingInputs, policy: ScalingPolicy) -> float | None:
    """The pool's score, renormalised over the present terms; None if neither is present."""
    latency = _usable(inputs.p95_latency_seconds)
    memory = _usable(inputs.memory_used_fraction)
    terms: list[tuple[float, float]] = []
    if latency is not None:
        terms.append((policy.latency_weight, latency / policy.latency_slo_seconds))
    if memory is not None:
        terms.append((policy.memory_weight, min(memory, 1.0)))
    total_weight = sum(weight for weight, _ in terms)
    if total_weight <= 0:
        return None
    return sum(weight * value for weight, value in terms) / total_weight


def _clamp(replicas: int, policy: ScalingPolicy) -> int:
    return max(policy.min_replicas, min(policy.max_replicas, replicas))


def _cooling(state: ScalingState, cooldown: float, now: float) -> float | None:
    """Seconds of cooldown left, or None if a scale event is allowed now."""
    if state.last_scale_at is None:
        return None
    left = cooldown - (now - state.last_scale_at)
    return left if left > 0 else None


def _scaled(state: ScalingState, replicas: int, direction: Direction, now: float,
            reason: str) -> ScalingDecision:
    new_state = replace(state, replicas=replicas, last_scale_at=now, last_direction=direction)
    return ScalingDecision(new_state, replicas, reason)


def decide_from_score(state: ScalingState, score: float | None, policy: ScalingPolicy,
                      now: float) -> ScalingDecision:
    """The decision for an already-computed score (see the module docstring for the rules).

    A NaN score counts as None (no telemetry).
    """
    if score is not None and math.isnan(score):
        score = None
    state = replace(state, score=score)
    current = state.replicas
    if current != _clamp(current, policy):
        target = _clamp(current, policy)
        direction: Direction = "up" if target > current else "down"
        return _scaled(state, target, direction, now,
                       f"clamped {current} -> {target} to [{policy.min_replicas}, "
                       f"{policy.max_replicas}]")
    if score is None:
        return ScalingDecision(state, current, "hold: no telemetry")
    if score > policy.scale_up_threshold:
        return _try_step(state, score, policy, now, "up")
    if score < policy.scale_down_threshold:
        return _try_step(state, score, policy, now, "down")
    return ScalingDecision(state, current, f"hold: score {score:.3f} within "
                                           f"[{policy.scale_down_threshold}, "
                                           f"{policy.scale_up_threshold}]")


def _try_step(state: ScalingState, score: float, policy: ScalingPolicy, now: float,
              direction: Direction) -> ScalingDecision:
    current = state.replicas
    if direction == "up":
        target, cooldown = current + policy.scale_up_step, policy.scale_up_cooldown_seconds
    else:
        target, cooldown = current - policy.scale_down_step, policy.scale_down_cooldown_seconds
    target = _clamp(target, policy)
    if target == current:
        bound = "max" if direction == "up" else "min"
        return ScalingDecision(state, current, f"hold: score {score:.3f} wants {direction} "
                                               f"but at {bound}_replicas {current}")
    left = _cooling(state, cooldown, now)
    if left is not None:
        return ScalingDecision(state, current, f"hold: score {score:.3f} wants {direction}, "
                                               f"cooldown {left:.0f}s left")
    return _scaled(state, target, direction, now,
                   f"scale {direction} {current} -> {target}: score {score:.3f}")


def decide(state: ScalingState, inputs: ScalingInputs, policy: ScalingPolicy,
           now: float) -> ScalingDecision:
    """One tick: ``(state, inputs, policy, now) -> (new_state, desired_replicas, reason)``."""
    return decide_from_score(state, compute_score(inputs, policy), policy, now)
