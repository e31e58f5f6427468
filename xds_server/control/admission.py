"""Each tick, every admitting pool's budget (``weight_calculator.admission``, pure) and what
one Envoy enforces of it (``envoy.admission``): the budget split evenly among the Envoys
that receive the admission layer, since each counts only its own requests in flight.

The budgets carry what they learn (each engine's concurrency) from one tick to the next;
nothing else is kept. A cluster without a budget gets no limit in the layer, so Envoy keeps
its static threshold and admits everything."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from weight_calculator.admission import AdmissionPolicy, PoolBudget, per_envoy, pool_budget
from weight_calculator.types import PoolWeights
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.envoy.admission import ClusterLimits, retry_after_seconds

log = logging.getLogger("trimtab.admission")


def policy_of(pool: PoolConfig) -> AdmissionPolicy | None:
    if not pool.admits or pool.slo.ttft_seconds is None:
        return None
    return AdmissionPolicy(pool.slo.ttft_seconds, pool.admission.wait_fraction)


@dataclass(frozen=True)
class AdmissionState:
    """The budgets in force (cluster -> budget) and how many Envoys share them."""

    budgets: Mapping[str, PoolBudget] = field(default_factory=dict)
    envoys: Mapping[str, int] = field(default_factory=dict)  # cluster -> Envoys sharing it

    def limits(self, config: Config) -> dict[str, ClusterLimits]:
        """One Envoy's limits per cluster (the RTDS layer)."""
        out: dict[str, ClusterLimits] = {}
        for pool in config.pools:
            for cluster, _, _ in pool.clusters():
                budget = self.budgets.get(cluster)
                if budget is None or budget.in_flight is None:
                    continue
                share = per_envoy(budget.in_flight, self.envoys.get(cluster, 1))
                batch = max(1, round(share * pool.admission.batch_share))
                out[cluster] = ClusterLimits(interactive=share, batch=min(share, batch))
        return out

    def retry_after(self, config: Config) -> dict[str, int]:
        """Each admitting pool's Retry-After: its stable cluster's prediction."""
        return {pool.name: retry_after_seconds(budget.retry_after_s)
                for pool in config.pools
                if (budget := self.budgets.get(pool.name)) is not None
                and budget.in_flight is not None}


def next_state(config: Config, weights: Mapping[str, PoolWeights], previous: AdmissionState,
               envoys: Callable[[PoolConfig], int]) -> AdmissionState:
    """The budgets from this tick's weights. ``envoys(pool)``: how many Envoys share it."""
    budgets: dict[str, PoolBudget] = {}
    counts: dict[str, int] = {}
    for pool in config.pools:
        policy = policy_of(pool)
        if policy is None:
            continue
        n = pool.admission.envoys or envoys(pool)
        for cluster, _, _ in pool.clusters():
            pw = weights.get(cluster)
            if pw is None:
                continue
            budgets[cluster] = pool_budget(pw, policy, previous.budgets.get(cluster))
            counts[cluster] = max(1, n)
    _log_changes(previous, budgets)
    return AdmissionState(budgets, counts)


def _log_changes(previous: AdmissionState, budgets: Mapping[str, PoolBudget]) -> None:
    for cluster, budget in budgets.items():
        before = previous.budgets.get(cluster)
        if before is None or (before.in_flight is None) != (budget.in_flight is None):
            log.info("admission %s: %s", cluster,
                     f"budget {budget.in_flight} in flight ({budget.reason})"
                     if budget.in_flight is not None else budget.reason)
