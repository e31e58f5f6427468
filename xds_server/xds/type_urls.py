"""xDS type URLs, and the order in which ADS must deliver them."""

from __future__ import annotations

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
RUNTIME = "type.googleapis.com/envoy.service.runtime.v3.Runtime"

# ADS ordering (xDS docs, "eventual consistency considerations"): CDS before EDS, LDS before RDS.
# RTDS (the admission layer) has no dependencies and comes last.
ADS_ORDER: tuple[str, ...] = (CLUSTER, ENDPOINT, LISTENER, ROUTE, RUNTIME)

# In SotW, Listener and Cluster responses carry the whole state of the world; the other types
# may carry only the resources that changed.
FULL_STATE_TYPES: frozenset[str] = frozenset({CLUSTER, LISTENER})

SHORT_NAMES: dict[str, str] = {CLUSTER: "cds", ENDPOINT: "eds", LISTENER: "lds", ROUTE: "rds",
                               RUNTIME: "rtds"}


def short_name(type_url: str) -> str:
    return SHORT_NAMES.get(type_url, type_url.rsplit(".", 1)[-1])
