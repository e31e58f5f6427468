"""From what telemetry knows to one cluster's weights, through the configured pure policy.

Adds what the policies leave to the caller: the windowed decode latency (ITL) from histogram
deltas, the configured capacity, the warm-up weight of an endpoint whose telemetry has not
arrived yet (only while it is younger than ``stale_after_seconds`` since first seen), and the
flags of rejected inputs (see :mod:`weight_calculator.adjust`); and, for every policy, what
losing telemetry means (:mod:`weight_calculator.loss`): staleness in missed ticks, a pool-wide
loss held fail-static at the weights from before it, and a garbled load signal counted as
saturated once its last good value is older than ``stale_after_seconds``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weight_calculator.adjust import flag_problems, warm_up, without_warm_up
from weight_calculator.composite import compute_composite_weights
from weight_calculator.gpu_memory import compute_pool_weights
from weight_calculator.inputs import CompositePolicy, EndpointInput, Signals
from weight_calculator.loss import hold_on_loss, on_tick_clock, restore_stamps, saturate
from weight_calculator.queueing import (
    STANDBY_WITH_FALLBACK,
    QueueingPolicy,
    compute_queueing_weights,
)
from weight_calculator.reference import compute_reference_weights
from weight_calculator.types import GpuMemoryPolicy, Observation, PoolWeights
from xds_server.config.pools import EndpointConfig, PoolConfig
from xds_server.config.schema import Config
from xds_server.telemetry.counters import ServiceHistory
from xds_server.telemetry.histories import HistogramHistory
from xds_server.telemetry.reading import HistogramState


def gpu_memory_policy(config: Config) -> GpuMemoryPolicy:
    return GpuMemoryPolicy(stale_after_seconds=config.telemetry.stale_after_seconds,
                           max_weight=config.weights.max_weight)


def composite_policy(config: Config, pool: PoolConfig) -> CompositePolicy:
    knobs = config.weights.composite.model_dump()
    if pool.itl_slo_ms is not None:
        knobs["itl_slo_ms"] = pool.itl_slo_ms
    return CompositePolicy(**knobs, max_weight=config.weights.max_weight,
                           stale_after_seconds=config.telemetry.stale_after_seconds)


def active_request_bias(pool: PoolConfig | None) -> float:
    """The exponent Envoy divides the pool's weights by: ``(active + 1) ** bias`` under
    least_request (Envoy's default bias 1), none under round robin or a hash."""
    if pool is None or pool.effective_lb_policy != "least_request":
        return 0.0
    return pool.active_request_bias if pool.active_request_bias is not None else 1.0


def queueing_policy(config: Config, pool: PoolConfig | None = None) -> QueueingPolicy:
    """The queueing knobs; a pool with a fallback puts fewer endpoints on standby, so
    standby never makes Envoy spill to the fallback (see ``STANDBY_WITH_FALLBACK``); under
    least_request the weights carry Envoy's ``(active + 1) ** bias`` divisor
    (``compensate_active``)."""
    share = STANDBY_WITH_FALLBACK if pool is not None and pool.fallback is not None else 0.5
    knobs = config.weights.queueing.model_dump()
    bias = active_request_bias(pool) if knobs.pop("compensate_active") else 0.0
    balancer = pool.effective_lb_policy if pool is not None else "least_request"
    # hash balancers (affinity) keep one locality: the tiers' weights are for the pickers
    knobs["capacity_tiers"] = knobs["capacity_tiers"] and balancer in ("least_request",
                                                                       "round_robin")
    return QueueingPolicy(**knobs, active_request_bias=bias,
                          equal_hosts=balancer == "least_request",
                          max_standby_share=share,
                          max_weight=config.weights.max_weight,
                          horizon_seconds=config.telemetry.interval_seconds,
                          stale_after_seconds=config.telemetry.stale_after_seconds)


class LatencyWindow:
    """Windowed mean ITL per endpoint from its reads' cumulative ITL histograms."""

    def __init__(self, window_s: float) -> None:
        self.history = HistogramHistory(window_s, max_samples=256)

    def record(self, address: str, at: float, state: HistogramState | None) -> None:
        if state is not None:
            self.history.record(address, at, state)

    def itl_ms(self, address: str, now: float) -> float | None:
        mean = self.history.mean(address, now)
        return mean * 1000.0 if mean is not None else None

    def forget(self, keep: set[str]) -> None:
        self.history.forget(lambda key: key in keep)


def _composite_input(endpoint: EndpointConfig, obs: Observation, itl: float | None
                     ) -> EndpointInput:
    if obs.sample is None:
        return EndpointInput(None, None, obs.error, endpoint.capacity)
    values = dict(obs.sample.signals)
    if itl is not None and "itl_ms" not in values:
        values["itl_ms"] = itl
    return EndpointInput(Signals.from_mapping(values), obs.sample.collected_at, obs.error,
                         endpoint.capacity)


def saturated_values(config: Config, pool: PoolConfig) -> dict[str, float]:
    """The raw value of each load signal that normalises to 1.0 (fully loaded)."""
    composite = config.weights.composite
    slo = pool.itl_slo_ms if pool.itl_slo_ms is not None else composite.itl_slo_ms
    return {"kv_usage": 1.0, "gpu_mem_pct": 100.0, "queue": float(composite.queue_cap),
            "itl_ms": 2.0 * slo}


def policy_observations(config: Config, pool: PoolConfig,
                        observations: Mapping[str, Observation], now: float,
                        previous: PoolWeights | None = None) -> dict[str, Observation]:
    """What every policy is given: saturated signals filled in, ages in missed ticks (less
    those excused by a pool-wide loss, see ``previous.excused``)."""
    telemetry = config.telemetry
    filled = saturate(observations, saturated_values(config, pool))
    return on_tick_clock(filled, telemetry.interval_seconds, telemetry.stale_after_seconds, now,
                         previous.excused if previous is not None else None)


def cluster_weights(config: Config, pool: PoolConfig, endpoints: Sequence[EndpointConfig],
                    observations: Mapping[str, Observation], latency: LatencyWindow,
                    now: float, previous: PoolWeights | None,
                    service: ServiceHistory | None = None) -> PoolWeights:
    """The pool policy's weights, then warm-up (endpoints younger than stale_after with no
    telemetry yet) and the flags of rejected inputs."""
    prior = without_warm_up(previous)
    read, observations = observations, policy_observations(config, pool, observations, now,
                                                           prior)
    if config.weights.policy == "composite":
        inputs = {ep.address: _composite_input(ep, observations[ep.address],
                                               latency.itl_ms(ep.address, now))
                  for ep in endpoints}
        weights = compute_composite_weights(inputs, composite_policy(config, pool), now, prior)
    elif config.weights.policy == "reference":
        inputs = {ep.address: _composite_input(ep, observations[ep.address], None)
                  for ep in endpoints}
        weights = compute_reference_weights(inputs, composite_policy(config, pool), now, prior)
    elif config.weights.policy == "queueing":
        inputs = {ep.address: _composite_input(ep, observations[ep.address], None)
                  for ep in endpoints}
        readings = {ep.address: service.readings(ep.address) if service else ()
                    for ep in endpoints}
        weights = compute_queueing_weights(inputs, readings, queueing_policy(config, pool), now, prior)
    else:
        weights = compute_pool_weights(observations, gpu_memory_policy(config), now, prior)
    weights = restore_stamps(hold_on_loss(weights, observations, prior), read)
    warmup = min(pool.warmup_weight, config.weights.max_weight)
    weights = warm_up(weights, observations, warmup, config.telemetry.stale_after_seconds, now)
    return flag_problems(weights, observations)
