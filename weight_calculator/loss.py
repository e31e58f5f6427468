"""Losing telemetry, decided the same way for every policy (applied around the policy call).

Pure functions only: the caller passes ``now``; nothing here reads a clock or does I/O.

* :func:`on_tick_clock` (before the policy): the staleness of an endpoint whose latest read
  failed is counted in *missed ticks* (``Observation.failures * interval``), not from its own
  read time, so endpoints that lost telemetry in the same tick cross ``stale_after`` in the
  same tick whatever their read latency or the tick phase. Its last good sample is handed to
  the policy re-stamped at ``now - failures * interval`` (to the float: the policy's own
  ``now - collected_at <= stale_after`` test gives the same answer). A sample older on the
  wall clock than ``stale_after + interval`` is stale however few ticks ran (a slow loop).
* :func:`hold_on_loss` (after the policy): a pool none of whose endpoints has a good latest
  read, while at least one had telemetry, lost it pool-wide (Prometheus or the network went
  away): it goes fail-static at once and every endpoint keeps the weight it had before the
  loss (``previous``). No endpoint can drop to weight 1 a tick before the pool goes
  fail-static, so fail-static never freezes such a 1.
  When the pool reads again, an endpoint's missed ticks from the loss are excused (carried
  in ``PoolWeights.excused``) until it reads again itself, so an endpoint that comes back a
  tick after the others keeps its weight too; one that never comes back goes stale
  ``stale_after`` after the pool recovered.
* :func:`restore_stamps` (after the policy): ``updated_at`` shows the real read time again.
* :func:`saturate` (before the policy): a load signal the server sends garbled for longer
  than ``stale_after`` (``Sample.saturated``) gets the value that normalises to 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from weight_calculator.health import DEGRADED, STALE
from weight_calculator.types import EndpointWeight, Observation, PoolWeights, Sample

_TOLERANCE = 1e-9  # relative: 3 * 0.1 counts as 0.3


def tick_fresh(failures: int, interval_s: float, stale_after_s: float) -> bool:
    """``failures`` missed ticks are within ``stale_after_s``."""
    return failures * interval_s <= stale_after_s * (1.0 + _TOLERANCE)


def _stamp(now: float, age: float, fresh: bool, stale_after_s: float) -> float:
    """``now - age``, nudged so that ``now - stamp <= stale_after_s`` is exactly ``fresh``."""
    stamp = now - age
    for _ in range(64):  # a few ulps at most
        if (now - stamp <= stale_after_s) == fresh:
            return stamp
        stamp = math.nextafter(stamp, math.inf if fresh else -math.inf)
    return stamp


def on_tick_clock(observations: Mapping[str, Observation], interval_s: float,
                  stale_after_s: float, now: float,
                  excused: Mapping[str, int] | None = None) -> dict[str, Observation]:
    """``observations`` with each failed endpoint's sample aged in missed ticks, less the
    ticks ``excused`` (those of a pool-wide loss the pool has come out of)."""
    excused = excused or {}
    changed: dict[str, Observation] = {}
    for address, obs in observations.items():
        sample = obs.sample
        if sample is None or obs.failures <= 0:
            continue
        forgiven = min(excused.get(address, 0), obs.failures)
        wall_age = now - sample.collected_at
        if not forgiven and not wall_age <= stale_after_s + interval_s:  # overdue (NaN too)
            continue
        missed = obs.failures - forgiven
        fresh = tick_fresh(missed, interval_s, stale_after_s)
        stamp = _stamp(now, missed * interval_s, fresh, stale_after_s)
        changed[address] = replace(obs, sample=replace(sample, collected_at=stamp))
    return {**observations, **changed} if changed else dict(observations)


def pool_lost(observations: Mapping[str, Observation]) -> bool:
    """No endpoint has a good latest read, and at least one had telemetry before."""
    if not observations:
        return False
    values = observations.values()
    return (all(o.sample is None or o.error is not None or o.failures > 0 for o in values)
            and any(o.sample is not None for o in values))


def _held(computed: EndpointWeight, prior: EndpointWeight | None) -> EndpointWeight:
    weight = prior.weight if prior is not None else computed.weight
    health = DEGRADED if prior is not None and prior.health == DEGRADED else STALE
    how = f"holding weight {weight} from before the loss" if prior is not None else \
        "no weight from before the loss"
    breakdown = {**computed.breakdown, "weight": float(weight)} if computed.breakdown else {}
    locality = prior.locality if prior is not None and prior.locality else computed.locality
    return replace(computed, weight=weight, stale=True, saturated=True, health=health,
                   breakdown=breakdown, locality=locality, reason=f"fail-static: no endpoint of the pool has fresh telemetry; {how} "
                          f"({computed.reason})")


def hold_on_loss(weights: PoolWeights, observations: Mapping[str, Observation],
                 previous: PoolWeights | None) -> PoolWeights:
    """Fail-static at once when the pool lost telemetry pool-wide (see :func:`pool_lost`);
    each endpoint keeps its weight in ``previous`` (the policy's where it has none), and the
    tick is excused to every endpoint (an endpoint dead before the loss stays dead: only the
    pool's lost ticks are excused, not its own earlier ones). Out of the loss, an endpoint's excuse lasts while it
    has not read again, so the endpoints that come back a tick later than the others keep
    their weight meanwhile (and go stale stale_after later if they never come back)."""
    if not pool_lost(observations):
        excused = {address: ticks for address, ticks in
                   (previous.excused.items() if previous is not None else ())
                   if address in observations and observations[address].failures > 0}
        return replace(weights, excused=excused) if excused or weights.excused else weights
    held = previous.endpoints if previous is not None else {}
    endpoints = {address: _held(ew, held.get(address))
                 for address, ew in weights.endpoints.items()}
    before = previous.excused if previous is not None else {}
    excused = {address: before.get(address, 0) + 1 for address in observations}  # lost ticks
    localities = previous.localities if previous is not None and previous.localities else \
        weights.localities  # held with the weights: a locality of none is weight 1
    return PoolWeights(endpoints=endpoints, fail_static=True, excused=excused,
                       localities=localities)


def restore_stamps(weights: PoolWeights, observations: Mapping[str, Observation]
                   ) -> PoolWeights:
    """Give every endpoint the real read time of its sample as ``updated_at``."""
    fixed = {}
    for address, obs in observations.items():
        ew = weights.endpoints.get(address)
        if obs.failures <= 0 or obs.sample is None or ew is None or ew.updated_at is None:
            continue  # only a failed endpoint's sample was re-stamped
        if ew.updated_at != obs.sample.collected_at:
            fixed[address] = replace(ew, updated_at=obs.sample.collected_at)
    if not fixed:
        return weights
    return replace(weights, endpoints={**weights.endpoints, **fixed})


def saturate(observations: Mapping[str, Observation], values: Mapping[str, float]
             ) -> dict[str, Observation]:
    """Each sample's ``saturated`` signals set to ``values[signal]`` (their saturated value)."""
    changed: dict[str, Observation] = {}
    for address, obs in observations.items():
        sample = obs.sample
        if sample is None or not sample.saturated:
            continue
        filled = {name: values[name] for name in sample.saturated if name in values}
        if filled:
            changed[address] = replace(obs, sample=_with(sample, filled))
    return {**observations, **changed} if changed else dict(observations)


def _with(sample: Sample, filled: Mapping[str, float]) -> Sample:
    return replace(sample, signals={**sample.signals, **filled})
