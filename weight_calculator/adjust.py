"""What is applied to a policy's weights afterwards: warm-up and flagged inputs.

Pure functions only: the caller passes ``now`` (and each endpoint's ``first_seen`` inside its
:class:`~weight_calculator.types.Observation`); nothing here reads a clock or does I/O.

* :func:`warm_up`: an endpoint with no telemetry yet gets ``warmup_weight`` (health
  ``WARMING``) while it is younger than ``window_s`` since first seen; after that it keeps
  what the policy gave it (weight 1, saturated, for an endpoint that never answered).
* :func:`flag_problems`: an endpoint whose sample had rejected or partly failed inputs
  carries them in ``EndpointWeight.problems`` and at the end of its ``reason``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from weight_calculator.health import WARMING
from weight_calculator.types import EndpointWeight, Observation, PoolWeights


def warming(obs: Observation, window_s: float, now: float) -> bool:
    """No sample yet, and first seen at most ``window_s`` ago (unknown first_seen: no)."""
    if obs.sample is not None or obs.first_seen is None:
        return False
    return now - obs.first_seen <= window_s


def _warm_reason(obs: Observation, window_s: float) -> str:
    detail = f" ({obs.error})" if obs.error else ""
    return f"warming up: no telemetry yet{detail}; for at most {window_s:g}s after first seen"


def warm_up(
    weights: PoolWeights,
    observations: Mapping[str, Observation],
    warmup_weight: int,
    window_s: float,
    now: float,
) -> PoolWeights:
    """Give warming endpoints ``warmup_weight``; a fail-static pool is left as it is."""
    if weights.fail_static:
        return weights
    endpoints = dict(weights.endpoints)
    for address, obs in observations.items():
        ew = endpoints.get(address)
        if ew is not None and warming(obs, window_s, now):
            endpoints[address] = replace(ew, weight=warmup_weight, saturated=False,
                                         health=WARMING, reason=_warm_reason(obs, window_s))
    return replace(weights, endpoints=endpoints, fail_static=False)


def without_warm_up(previous: PoolWeights | None) -> PoolWeights | None:
    """``previous`` minus its warm-up weights: a guess must not be smoothed from or held."""
    if previous is None:
        return None
    kept = {a: ew for a, ew in previous.endpoints.items() if ew.health != WARMING}
    if len(kept) == len(previous.endpoints):
        return previous
    return replace(previous, endpoints=kept)


def _flagged(ew: EndpointWeight, problems: tuple[str, ...]) -> EndpointWeight:
    reason = f"{ew.reason}; input problems: {'; '.join(problems)}"
    return replace(ew, problems=problems, reason=reason)


def flag_problems(weights: PoolWeights, observations: Mapping[str, Observation]) -> PoolWeights:
    """Copy each sample's ``problems`` onto its endpoint's weight (and reason)."""
    flagged = {
        address: _flagged(weights.endpoints[address], obs.sample.problems)
        for address, obs in observations.items()
        if obs.sample is not None and obs.sample.problems and address in weights.endpoints
    }
    if not flagged:
        return weights
    return replace(weights, endpoints={**weights.endpoints, **flagged})
