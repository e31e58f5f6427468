"""CDS and EDS resources built from the config and the current weights (LDS/RDS: routing.py).

Pure functions: config + weights in, protobuf messages out. Every nested Any is packed with
deterministic serialisation so that content hashes (and so versions) are stable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2

from .config import PoolConfig, parse_host_port

HEALTHY = "HEALTHY"
DRAINING = "DRAINING"
DEGRADED = "DEGRADED"

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
}
_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Upstream connections stay open across long streams; only truly idle ones are closed.
UPSTREAM_IDLE_TIMEOUT_S = 3600
CONNECT_TIMEOUT_MS = 2000


@dataclass(frozen=True)
class EndpointSetting:
    """What EDS says about one endpoint. `weight` is always >= 1: Envoy NACKs 0."""

    weight: int
    health: str = HEALTHY


def build_cluster(pool: PoolConfig) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster(name=pool.name, type=cluster_pb2.Cluster.EDS,
                                  lb_policy=_LB_POLICIES[pool.lb_policy])
    eds = cluster.eds_cluster_config
    eds.service_name = pool.name
    eds.eds_config.ads.SetInParent()
    eds.eds_config.resource_api_version = config_source_pb2.V3
    cluster.connect_timeout.FromMilliseconds(CONNECT_TIMEOUT_MS)
    # Apply weight changes at once rather than batching them for Envoy's default 1 s.
    cluster.common_lb_config.update_merge_window.FromSeconds(0)
    thresholds = cluster.circuit_breakers.thresholds.add()
    for limit in ("max_connections", "max_pending_requests", "max_requests"):
        getattr(thresholds, limit).value = 100_000  # Envoy's 1024 default caps LLM concurrency
    options = http_protocol_options_pb2.HttpProtocolOptions()
    options.common_http_protocol_options.idle_timeout.FromSeconds(UPSTREAM_IDLE_TIMEOUT_S)
    options.explicit_http_config.http_protocol_options.SetInParent()
    cluster.typed_extension_protocol_options[_HTTP_OPTIONS].Pack(options, deterministic=True)
    return cluster


def build_load_assignment(pool: PoolConfig, settings: Mapping[str, EndpointSetting]
                          ) -> endpoint_pb2.ClusterLoadAssignment:
    """One locality (with a weight, so proxyless gRPC clients accept it) holding every endpoint.
    Endpoints missing from `settings` get weight 1; drained ones are DRAINING."""
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=pool.name)
    locality = assignment.endpoints.add()
    locality.locality.region = "trimtab"
    locality.locality.zone = "default"
    locality.load_balancing_weight.value = 1
    for endpoint in pool.endpoints:
        setting = settings.get(endpoint.address, EndpointSetting(1))
        health = DRAINING if endpoint.drain else setting.health
        host_port = parse_host_port(endpoint.address)
        lb = locality.lb_endpoints.add()
        lb.endpoint.address.socket_address.address = host_port.host
        lb.endpoint.address.socket_address.port_value = host_port.port
        lb.load_balancing_weight.value = max(1, int(setting.weight))
        lb.health_status = _HEALTH[health]
    return assignment
