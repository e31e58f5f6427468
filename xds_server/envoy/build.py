"""Inputs -> resources, pure: everything trimtab serves, built from the config, the canary
shares, the automatic prompt-size classes and the weights.

The parts that change only with the config (:class:`ConfigResources`: clusters, listener) or
with the routing inputs (:class:`RouteResources`: routes, derived clusters) are built once
when those change and reused by every tick, so each is encoded once; only the
ClusterLoadAssignments follow the weights (:func:`build_resources`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from google.protobuf.message import Message

from weight_calculator.health import DEGRADED as DEGRADED_HEALTH
from weight_calculator.health import STANDBY
from weight_calculator.types import PoolWeights
from xds_server.config.schema import Config
from xds_server.envoy.admission import NO_ADMISSION, ClusterLimits, RouteAdmission, runtime_layer
from xds_server.envoy.clusters import (
    DEGRADED,
    HEALTHY,
    EndpointSetting,
    build_cluster,
    build_clusters,
    build_load_assignment,
)
from xds_server.envoy.prompt_classes import AutoClass
from xds_server.envoy.request_features import extra_clusters as feature_clusters
from xds_server.envoy.routes import build_listener, build_route_config
from xds_server.xds import type_urls

AutoClasses = Mapping[str, tuple[AutoClass, ...]]  # pool -> its derived classes


@dataclass(frozen=True)
class ConfigResources:
    """What one config gives: every pool's clusters (and the request-feature clusters) and
    the listener."""

    config: Config
    clusters: tuple[Message, ...]
    listener: Message


def config_resources(config: Config) -> ConfigResources:
    clusters = [c for pool in config.pools for c in build_clusters(pool)]
    return ConfigResources(config, (*clusters, *feature_clusters(config)), build_listener(config))


@dataclass(frozen=True)
class RouteResources:
    """What the routing inputs give: the RDS routes and the automatic classes' clusters.
    ``canary_percent`` is kept as the one object the routes were built from (per-node
    views compare it by identity)."""

    config: Config
    canary_percent: Mapping[str, float]
    auto: AutoClasses
    auto_clusters: tuple[Message, ...]
    routes: Message
    admission: RouteAdmission = NO_ADMISSION

    def built_from(self, config: Config, canary_percent: Mapping[str, float],
                   auto: AutoClasses, admission: RouteAdmission = NO_ADMISSION) -> bool:
        return (self.config is config and self.canary_percent == canary_percent
                and self.auto == auto and self.admission == admission)


def route_resources(config: Config, canary_percent: Mapping[str, float],
                    auto: AutoClasses, admission: RouteAdmission = NO_ADMISSION
                    ) -> RouteResources:
    """``admission``: what admitting pools' routes carry (quantised: it changes rarely)."""
    auto_clusters = tuple(build_cluster(config.pool(name), c.cluster)
                          for name, classes in auto.items() for c in classes)
    return RouteResources(config, canary_percent, auto, auto_clusters,
                          build_route_config(config, canary_percent, auto, admission),
                          admission)


def eds_health(health: str) -> str:
    """DEGRADED reaches EDS as DEGRADED; everything else as HEALTHY: stale or invalid
    telemetry is expressed through weight, the queueing policy's STANDBY through priority
    (:func:`eds_priority`)."""
    return DEGRADED if health == DEGRADED_HEALTH else HEALTHY


def eds_priority(health: str) -> int:
    """STANDBY endpoints are priority 1: Envoy sends them nothing while priority 0 is
    available (healthy hosts x 1.4, the overprovisioning factor, cover it), and fails over to
    them when it is not (hosts failing health checks between ticks). As DRAINING in priority
    0 they used to thin out its healthy hosts, and below 1/1.4 of them healthy Envoy spills a
    share of the traffic onto the DEGRADED ones (KV full)."""
    return 1 if health == STANDBY else 0


def endpoint_settings(weights: Mapping[str, PoolWeights]
                      ) -> dict[str, dict[str, EndpointSetting]]:
    """cluster -> address -> the EDS weight and health."""
    return {cluster: {address: EndpointSetting(ew.weight, eds_health(ew.health), ew.locality,
                                               pw.localities.get(ew.locality or "", 1),
                                               eds_priority(ew.health))
                      for address, ew in pw.endpoints.items()}
            for cluster, pw in weights.items()}


def build_resources(static: ConfigResources, routing: RouteResources,
                    weights: Mapping[str, PoolWeights],
                    limits: Mapping[str, ClusterLimits] | None = None,
                    enforced: Iterable[str] = ()) -> dict[str, list[Message]]:
    """Every resource by type URL: the config's clusters and the derived ones, a
    ClusterLoadAssignment per cluster with its weights, the listener, the routes and the
    admission layer (``limits``: one Envoy's limits per cluster; ``enforced``: the clusters
    whose tenant limit refuses now; always served, empty when nothing is limited, so an
    Envoy whose bootstrap names the layer never waits for it)."""
    settings = endpoint_settings(weights)
    config = static.config
    assignments = [build_load_assignment(name, endpoints, settings.get(name, {}))
                   for pool in config.pools for name, _, endpoints in pool.clusters()]
    return {
        type_urls.CLUSTER: [*static.clusters, *routing.auto_clusters],
        type_urls.ENDPOINT: [*assignments,
                             *_auto_assignments(config, routing.auto, settings, weights)],
        type_urls.LISTENER: [static.listener],
        type_urls.ROUTE: [routing.routes],
        type_urls.RUNTIME: [runtime_layer(limits or {}, enforced)],
    }


def _auto_assignments(config: Config, auto: AutoClasses,
                      settings: Mapping[str, Mapping[str, EndpointSetting]],
                      weights: Mapping[str, PoolWeights]) -> list[Message]:
    """Each derived cluster holds its members with the pool's health and weights. A pool
    published as capacity tiers gives them its localities as they are (equal weights inside
    a tier carry no divisor). Otherwise, under the queueing policy, the weights without
    Envoy's divisor (``share_weight``): Envoy counts active requests per cluster, and a
    derived cluster carries only its class's few, so the pool's in-flight factor would skew
    it (measured: long prompts piled on the H100 whose pool-wide count was larger)."""
    out: list[Message] = []
    for name, classes in auto.items():
        by_address = {ep.address: ep for ep in config.pool(name).endpoints}
        own = settings.get(name, {})
        shares = weights.get(name)
        tiered = shares is not None and bool(shares.localities)
        derived = {a: EndpointSetting(int(ew.breakdown.get("share_weight", own[a].weight)),
                                      own[a].health, priority=own[a].priority)
                   for a, ew in (shares.endpoints.items() if shares else ())
                   if a in own and not tiered}
        for c in classes:
            members = [by_address[a] for a in c.addresses if a in by_address]
            out.append(build_load_assignment(c.cluster, members, derived or own))
    return out
