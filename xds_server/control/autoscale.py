"""Per-pool autoscaling answers for KEDA: the seed's dual-metric score every tick.

score = 0.6 × (P95 TTFT / latency SLO) + 0.4 × (memory in use), memory being KV-cache use where
the server reports it, else GPU framebuffer use, averaged over the pool's fresh endpoints.
The decision itself is the pure `weight_calculator.scaling.decide`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from weight_calculator.scaling import (
    ScalingInputs,
    ScalingPolicy,
    ScalingState,
    decide,
    initial_state,
)
from weight_calculator.types import PoolWeights
from xds_server.admin.metrics import DESIRED_REPLICAS, SCALE_SCORE
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.control.slo import SloTracker
from xds_server.keda.scaler import InMemoryScaleSource, PoolScale

log = logging.getLogger("trimtab.autoscale")

LATENCY_WINDOW_S = 60.0


def _policy(pool: PoolConfig) -> ScalingPolicy:
    return ScalingPolicy(**pool.scaling.model_dump()) if pool.scaling else ScalingPolicy()


def _memory(weights: list[PoolWeights]) -> float | None:
    values = []
    for pool_weights in weights:
        for ew in pool_weights.endpoints.values():
            if ew.stale:
                continue
            if "kv_usage" in ew.signals:
                values.append(ew.signals["kv_usage"])
            elif "gpu_mem_pct" in ew.signals:
                values.append(ew.signals["gpu_mem_pct"] / 100.0)
    return sum(values) / len(values) if values else None


class Autoscaler:
    def __init__(self, config: Config) -> None:
        self.source = InMemoryScaleSource()
        self.states: dict[str, ScalingState] = {}
        self.apply_config(config)

    def apply_config(self, config: Config) -> None:
        self.pools = {pool.name: pool for pool in config.pools}
        for name in [n for n in self.states if n not in self.pools]:
            del self.states[name]
            self.source.remove(name)
            SCALE_SCORE.remove(name)  # a removed pool leaves no series behind
            DESIRED_REPLICAS.remove(name)

    def tick(self, weights: Mapping[str, PoolWeights], slo: SloTracker, now: float) -> None:
        for name, pool in self.pools.items():
            policy = _policy(pool)
            clusters = [cluster for cluster, _, _ in pool.clusters()]
            addresses = [ep.address for ep in pool.all_endpoints()]
            inputs = ScalingInputs(
                p95_latency_seconds=slo.stats(addresses, now - LATENCY_WINDOW_S).ttft_p95_s,
                memory_used_fraction=_memory([weights[c] for c in clusters if c in weights]))
            state = self.states.get(name) or initial_state(policy)
            decision = decide(state, inputs, policy, now)
            if decision.desired_replicas != state.replicas:
                log.info("autoscale %s: %d -> %d replicas (%s)", name, state.replicas,
                         decision.desired_replicas, decision.reason)
            self.states[name] = decision.state
            score = decision.state.score
            self.source.update(name, PoolScale(decision.desired_replicas, score=score))
            DESIRED_REPLICAS.labels(pool=name).set(decision.desired_replicas)
            if score is not None:
                SCALE_SCORE.labels(pool=name).set(score)
            else:
                SCALE_SCORE.remove(name)  # no telemetry: no score, rather than a stale one
