"""CDS and EDS resources built from the config and the current weights (LDS/RDS: routing.py).

Pure functions: config + weights in, protobuf messages out. Every nested Any is packed with
deterministic serialisation so that content hashes (and so versions) are stable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from xds_server.config.addresses import HostPort, parse_host_port
from xds_server.config.pools import EndpointConfig, PoolConfig
from xds_server.envoy import request_features

HEALTHY = "HEALTHY"
DRAINING = "DRAINING"
DEGRADED = "DEGRADED"
UNHEALTHY = "UNHEALTHY"

_LB_POLICIES = {
    "round_robin": cluster_pb2.Cluster.ROUND_ROBIN,
    "least_request": cluster_pb2.Cluster.LEAST_REQUEST,
    "ring_hash": cluster_pb2.Cluster.RING_HASH,
    "maglev": cluster_pb2.Cluster.MAGLEV,
    "random": cluster_pb2.Cluster.RANDOM,
}
_HEALTH = {
    HEALTHY: health_check_pb2.HEALTHY,
    DRAINING: health_check_pb2.DRAINING,
    DEGRADED: health_check_pb2.DEGRADED,
    UNHEALTHY: health_check_pb2.UNHEALTHY,
}
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Upstream connections stay open across long streams; only truly idle ones are closed.
UPSTREAM_IDLE_TIMEOUT_S = 3600


@dataclass(frozen=True)
class EndpointSetting:
    """What EDS says about one endpoint. `weight` is always >= 1: Envoy NACKs 0.
    ``locality``: the Envoy locality (capacity tier) it is published in, with that
    locality's ``locality_weight``; None: the default locality."""

    weight: int
    health: str = HEALTHY
    locality: str | None = None
    locality_weight: int = 1
    priority: int = 0  # 1: standby (weight_calculator.health.STANDBY), failover only


_UNWEIGHED = EndpointSetting(1)  # endpoints missing from the settings
DEFAULT_ZONE = "default"


def _circuit_breakers(cluster: cluster_pb2.Cluster, pool: PoolConfig) -> None:
    thresholds = cluster.circuit_breakers.thresholds.add()
    limits = pool.circuit_breakers
    thresholds.max_connections.value = limits.max_connections
    thresholds.max_pending_requests.value = limits.max_pending_requests
    thresholds.max_requests.value = limits.max_requests
    thresholds.retry_budget.budget_percent.value = pool.retry_policy.budget_percent
    thresholds.retry_budget.min_retry_concurrency.value = pool.retry_policy.min_retry_concurrency


def _outlier_detection(cluster: cluster_pb2.Cluster, pool: PoolConfig) -> None:
    outlier = pool.outlier_detection
    if not outlier.enabled:
        return
    detection = cluster.outlier_detection
    detection.consecutive_5xx.value = outlier.consecutive_5xx
    detection.interval.FromMilliseconds(int(outlier.interval_seconds * 1000))
    detection.base_ejection_time.FromMilliseconds(int(outlier.base_ejection_seconds * 1000))
    detection.max_ejection_percent.value = outlier.max_ejection_percent
    detection.enforcing_consecutive_5xx.value = 100
    detection.enforcing_success_rate.value = 0  # success-rate ejection needs volume we lack


def _slow_start(cluster: cluster_pb2.Cluster, pool: PoolConfig) -> None:
    if pool.slow_start is None:
        return
    lb_config = (cluster.round_robin_lb_config if pool.effective_lb_policy == "round_robin"
                 else cluster.least_request_lb_config)
    slow = lb_config.slow_start_config
    slow.slow_start_window.FromMilliseconds(int(pool.slow_start.window_seconds * 1000))
    slow.aggression.default_value = pool.slow_start.aggression
    slow.aggression.runtime_key = f"trimtab.{pool.name}.slow_start_aggression"
    slow.min_weight_percent.value = pool.slow_start.min_weight_percent


def _least_request(cluster: cluster_pb2.Cluster, pool: PoolConfig) -> None:
    if pool.effective_lb_policy == "least_request":
        cluster.least_request_lb_config.choice_count.value = pool.choice_count
    if pool.active_request_bias is None:
        return
    bias = cluster.least_request_lb_config.active_request_bias
    bias.default_value = pool.active_request_bias
    bias.runtime_key = f"trimtab.{pool.name}.active_request_bias"


def _health_check(cluster: cluster_pb2.Cluster, pool: PoolConfig) -> None:
    if pool.health_check is None:
        return
    config = pool.health_check
    check = cluster.health_checks.add()
    check.timeout.FromMilliseconds(int(config.timeout_seconds * 1000))
    check.interval.FromMilliseconds(int(config.interval_seconds * 1000))
    # Envoy checks a cluster that has not carried traffic yet only every 60 s by default, and
    # keeps that timer armed once traffic starts: a host that dies early goes unnoticed for up
    # to a minute. The configured interval is the interval, traffic or not.
    check.no_traffic_interval.FromMilliseconds(int(config.interval_seconds * 1000))
    check.unhealthy_threshold.value = config.unhealthy_threshold
    check.healthy_threshold.value = config.healthy_threshold
    check.http_health_check.path = config.path
    # EDS health (DEGRADED/DRAINING from telemetry) and active checks combine: both must pass.
    cluster.common_lb_config.ignore_new_hosts_until_first_hc = False


def build_cluster(pool: PoolConfig, name: str) -> cluster_pb2.Cluster:
    """One EDS cluster of `pool` (its stable version, or the canary)."""
    cluster = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS,
                                  lb_policy=_LB_POLICIES[pool.effective_lb_policy])
    eds = cluster.eds_cluster_config
    eds.service_name = name
    eds.eds_config.ads.SetInParent()
    eds.eds_config.resource_api_version = config_source_pb2.V3
    cluster.connect_timeout.FromMilliseconds(int(pool.timeouts.connect_seconds * 1000))
    # Apply weight changes at once rather than batching them for Envoy's default 1 s.
    cluster.common_lb_config.update_merge_window.FromSeconds(0)
    # Capacity tiers are localities whose weights carry the tiers' shares (EDS); with one
    # locality (every other policy) this changes nothing.
    cluster.common_lb_config.locality_weighted_lb_config.SetInParent()
    _circuit_breakers(cluster, pool)
    _outlier_detection(cluster, pool)
    _slow_start(cluster, pool)
    _least_request(cluster, pool)
    _health_check(cluster, pool)
    options = http_protocol_options_pb2.HttpProtocolOptions()
    options.common_http_protocol_options.idle_timeout.FromSeconds(UPSTREAM_IDLE_TIMEOUT_S)
    options.explicit_http_config.http_protocol_options.SetInParent()
    cluster.typed_extension_protocol_options[_HTTP_OPTIONS].Pack(options, deterministic=True)
    return cluster


def build_aggregate_cluster(name: str, members: Sequence[str]) -> cluster_pb2.Cluster:
    """An aggregate cluster: Envoy fills `members` in order, spilling to the next one only when
    the healthy hosts of the earlier ones fall short (down, DEGRADED, ejected)."""
    cluster = cluster_pb2.Cluster(name=name, lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED)
    cluster.connect_timeout.FromMilliseconds(2000)
    cluster.cluster_type.name = "envoy.clusters.aggregate"
    cluster.cluster_type.typed_config.Pack(aggregate_pb2.ClusterConfig(clusters=list(members)),
                                           deterministic=True)
    return cluster


def build_clusters(pool: PoolConfig) -> list[cluster_pb2.Cluster]:
    clusters = [build_cluster(pool, name) for name, _, _ in pool.clusters()]
    if pool.fallback is not None:
        clusters.append(build_aggregate_cluster(pool.fallback_cluster, [pool.name, pool.fallback]))
    for target in sorted(set(pool.model_versions.pools.values()) if pool.model_versions else ()):
        clusters.append(build_aggregate_cluster(request_features.version_cluster(pool, target),
                                                request_features.version_members(pool, target)))
    return clusters


@lru_cache(maxsize=1 << 18)
def _host_port(address: str) -> HostPort:
    """`parse_host_port`, once per address rather than per endpoint per tick."""
    return parse_host_port(address)


def build_load_assignment(cluster_name: str, endpoints: Sequence[EndpointConfig],
                          settings: Mapping[str, EndpointSetting]
                          ) -> endpoint_pb2.ClusterLoadAssignment:
    """One locality per (priority, capacity tier) named in `settings` (zone = the tier,
    weight = its share; see weight_calculator.localities), priority 0 first, then by name;
    else one locality (with a weight, so proxyless gRPC clients accept it) holding every
    endpoint. Standby endpoints are priority 1. Endpoints missing from `settings` get
    weight 1 in the default locality; drained ones are DRAINING."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name)
    groups: dict[tuple[int, str], list[EndpointConfig]] = {}
    weights: dict[tuple[int, str], int] = {}
    for endpoint in endpoints:
        setting = settings.get(endpoint.address, _UNWEIGHED)
        key = (setting.priority, setting.locality or DEFAULT_ZONE)
        groups.setdefault(key, []).append(endpoint)
        weights[key] = max(weights.get(key, 1), int(setting.locality_weight))
    if groups and min(p for p, _ in groups) > 0:  # no priority 0 left: the standby serve
        groups = {(0, zone): members for (_, zone), members in groups.items()}
        weights = {(0, zone): w for (_, zone), w in weights.items()}
    for key in sorted(groups) or [(0, DEFAULT_ZONE)]:
        priority, zone = key
        locality = assignment.endpoints.add()
        locality.locality.region = "trimtab"
        locality.locality.zone = zone
        locality.load_balancing_weight.value = max(1, weights.get(key, 1))
        locality.priority = priority
        for endpoint in groups.get(key, ()):
            setting = settings.get(endpoint.address, _UNWEIGHED)
            health = DRAINING if endpoint.drain else setting.health
            host_port = _host_port(endpoint.address)
            lb = locality.lb_endpoints.add()
            lb.endpoint.address.socket_address.address = host_port.host
            lb.endpoint.address.socket_address.port_value = host_port.port
            lb.load_balancing_weight.value = max(1, int(setting.weight))
            lb.health_status = _HEALTH[health]
    return assignment
