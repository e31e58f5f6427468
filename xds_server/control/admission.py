"""Each tick, every admitting pool's budget (``weight_calculator.admission``, pure) and what
one Envoy enforces of it (``envoy.admission``): the budget split evenly among the Envoys
that receive the admission layer, since each counts only its own requests in flight; and,
for a pool with a tenant header, its tenant cap (``weight_calculator.fairness``, pure) and
whether it is enforced.

The budgets carry what they learn (each engine's concurrency) from one tick to the next, the
tenant caps their level and what the servers held; nothing else is kept. A cluster without
a budget gets no limit in the layer, so Envoy keeps its static threshold and admits
everything; a pool without one has no tenant limit either."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from weight_calculator.admission import AdmissionPolicy, PoolBudget, per_envoy, pool_budget
from weight_calculator.fairness import TenantCap, next_cap
from weight_calculator.spill import next_spill
from weight_calculator.types import PoolWeights
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.envoy.admission import ClusterLimits, RouteAdmission, retry_after_seconds

log = logging.getLogger("trimtab.admission")


def policy_of(pool: PoolConfig) -> AdmissionPolicy | None:
    if not pool.admits or pool.slo.ttft_seconds is None:
        return None
    return AdmissionPolicy(pool.slo.ttft_seconds, pool.admission.wait_fraction)


@dataclass(frozen=True)
class AdmissionState:
    """The budgets in force (cluster -> budget), how many Envoys share them, and the tenant
    caps (stable cluster -> cap) of the pools with a tenant header."""

    budgets: Mapping[str, PoolBudget] = field(default_factory=dict)
    envoys: Mapping[str, int] = field(default_factory=dict)  # cluster -> Envoys sharing it
    tenants: Mapping[str, TenantCap] = field(default_factory=dict)
    spill: Mapping[str, int] = field(default_factory=dict)  # pool -> per mille to its fallback

    def tenant_levels(self) -> dict[str, int]:
        """Each pool's tenant cap level (its routes carry it)."""
        return {cluster: cap.level for cluster, cap in self.tenants.items()}

    def routes(self, config: Config) -> RouteAdmission:
        """What the routes carry: Retry-After, tenant cap levels, spills (only non-zero)."""
        return RouteAdmission(self.retry_after(config), self.tenant_levels(),
                              {pool: share for pool, share in self.spill.items() if share > 0})

    def enforced(self) -> list[str]:
        """The clusters whose tenant limit refuses now (the layer turns it on)."""
        return sorted(cluster for cluster, cap in self.tenants.items() if cap.enforced)

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
    tenants: dict[str, TenantCap] = {}
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
        cap = _tenant_cap(pool, budgets, counts, previous)
        if cap is not None:
            tenants[pool.name] = cap
    spill = {pool.name: next_spill(budgets[pool.name], budgets.get(pool.fallback or ""),
                                   previous.spill.get(pool.name, 0))
             for pool in config.pools
             if pool.fallback is not None and pool.admission.spill_to_fallback
             and pool.name in budgets}
    _log_changes(previous, budgets)
    _log_tenants(previous, tenants)
    _log_spill(previous, spill)
    return AdmissionState(budgets, counts, tenants, spill)


def _log_spill(previous: AdmissionState, spill: Mapping[str, int]) -> None:
    for pool, share in spill.items():
        if (share > 0) != (previous.spill.get(pool, 0) > 0):
            log.info("admission %s: %s", pool,
                     f"over its budget: {share / 10:g} % of new requests go to its fallback"
                     if share > 0 else "back within its budget: nothing spills")


def _tenant_cap(pool: PoolConfig, budgets: Mapping[str, PoolBudget],
                counts: Mapping[str, int], previous: AdmissionState) -> TenantCap | None:
    """The cap of a pool with a tenant header, steered by its stable cluster's budget."""
    budget = budgets.get(pool.name)
    if not pool.admission.tenant_header or budget is None:
        return None
    return next_cap(budget, counts.get(pool.name, 1), previous.tenants.get(pool.name))


def _log_tenants(previous: AdmissionState, tenants: Mapping[str, TenantCap]) -> None:
    for cluster, cap in tenants.items():
        before = previous.tenants.get(cluster)
        if cap.enforced != (before is not None and before.enforced):
            log.info("tenant limit %s: %s", cluster,
                     f"enforced at {cap.rate:.3g} requests/s per tenant per Envoy"
                     if cap.enforced else "off (the pool has room)")


def _log_changes(previous: AdmissionState, budgets: Mapping[str, PoolBudget]) -> None:
    for cluster, budget in budgets.items():
        before = previous.budgets.get(cluster)
        if before is None or (before.in_flight is None) != (budget.in_flight is None):
            log.info("admission %s: %s", cluster,
                     f"budget {budget.in_flight} in flight ({budget.reason})"
                     if budget.in_flight is not None else budget.reason)
