"""Small xDS resource sets for unit tests (no Envoy, no gRPC)."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)

from xds_server.xds import type_urls
from xds_server.xds.snapshot import Snapshot, build_snapshot


def cluster(name: str) -> cluster_pb2.Cluster:
    c = cluster_pb2.Cluster(name=name, type=cluster_pb2.Cluster.EDS)
    c.eds_cluster_config.eds_config.ads.SetInParent()
    c.connect_timeout.FromMilliseconds(1000)
    return c


def cla(name: str, weights: dict[str, int]) -> endpoint_pb2.ClusterLoadAssignment:
    assignment = endpoint_pb2.ClusterLoadAssignment(cluster_name=name)
    locality = assignment.endpoints.add()
    locality.load_balancing_weight.value = 1
    for address, weight in sorted(weights.items()):
        host, port = address.rsplit(":", 1)
        lb = locality.lb_endpoints.add()
        lb.endpoint.address.socket_address.address = host
        lb.endpoint.address.socket_address.port_value = int(port)
        lb.load_balancing_weight.value = weight
    return assignment


def listener(route_name: str = "routes") -> listener_pb2.Listener:
    hcm = hcm_pb2.HttpConnectionManager(stat_prefix="x")
    hcm.rds.route_config_name = route_name
    hcm.rds.config_source.ads.SetInParent()
    lst = listener_pb2.Listener(name="listener")
    lst.address.socket_address.address = "127.0.0.1"
    lst.address.socket_address.port_value = 10000
    lst.filter_chains.add().filters.add(name="hcm").typed_config.Pack(hcm, deterministic=True)
    return lst


def routes(clusters: list[str], name: str = "routes") -> route_pb2.RouteConfiguration:
    rc = route_pb2.RouteConfiguration(name=name)
    vh = rc.virtual_hosts.add(name="all", domains=["*"])
    for c in clusters:
        r = vh.routes.add()
        r.match.prefix = f"/{c}"
        r.route.cluster = c
    return rc


def snapshot(weights: dict[str, dict[str, int]]) -> Snapshot:
    names = sorted(weights)
    return build_snapshot({
        type_urls.CLUSTER: [cluster(n) for n in names],
        type_urls.ENDPOINT: [cla(n, weights[n]) for n in names],
        type_urls.LISTENER: [listener()],
        type_urls.ROUTE: [routes(names)],
    })


BASE = {"a": {"10.0.0.1:80": 50, "10.0.0.2:80": 50}, "b": {"10.0.1.1:80": 10}}
