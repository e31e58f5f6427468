"""Admission in Envoy, with no per-request hop: each cluster's circuit-breaker limit on
requests in flight, per routing priority, set at run time by an RTDS layer.

Envoy reads ``circuit_breakers.<cluster>.<priority>.max_requests`` from its runtime before the
cluster's static threshold, so a budget that changes every tick is a runtime update: no CDS
update, no cluster rebuilt, no connection drained. A request over the limit is refused by
Envoy at once (response flag UO), and the listener's local reply turns that into an
OpenAI-shaped 429 with ``Retry-After`` (``local_replies.py``); the value comes from the
route's metadata (``trimtab.retry_after``), so it changes with RDS, never with LDS.

Interactive requests go at priority HIGH and may hold the whole budget; batch requests at
DEFAULT hold at most ``batch_share`` of it, so batch is refused first. A cluster missing from
the layer (no budget measured yet) keeps its static threshold: everything is admitted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envoy.service.runtime.v3 import rtds_pb2

from xds_server.config.pools import PoolConfig

RUNTIME_LAYER = "trimtab-admission"
RETRY_AFTER_KEY = "retry_after"
HIGH, DEFAULT = "high", "default"
INTERACTIVE, BATCH = "interactive", "batch"
ENVOY_PRIORITY = {INTERACTIVE: "HIGH", BATCH: "DEFAULT"}
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class ClusterLimits:
    """One Envoy's limits on requests in flight to one cluster."""

    interactive: int
    batch: int


def runtime_key(cluster: str, priority: str) -> str:
    return f"circuit_breakers.{cluster}.{priority}.max_requests"


def runtime_layer(limits: Mapping[str, ClusterLimits]) -> rtds_pb2.Runtime:
    """The RTDS resource: one key per cluster and priority, sorted (a Struct is a map, and
    the snapshot hashes its deterministic serialisation)."""
    runtime = rtds_pb2.Runtime(name=RUNTIME_LAYER)
    fields = runtime.layer.fields
    for cluster in sorted(limits):
        fields[runtime_key(cluster, HIGH)].number_value = limits[cluster].interactive
        fields[runtime_key(cluster, DEFAULT)].number_value = limits[cluster].batch
    return runtime


def retry_after_seconds(predicted_s: float) -> int:
    """The Retry-After a refused request is told: the predicted wait rounded up to a power of
    two seconds (1, 2, 4, ... 32, then 60), so the routes change only when the prediction
    moves by a factor, not every tick."""
    if predicted_s <= 1:
        return 1
    step = 1
    while step < predicted_s and step < MAX_RETRY_AFTER_S:
        step *= 2
    return min(step, MAX_RETRY_AFTER_S)


def _with_header(route: dict[str, Any], header: dict[str, Any]) -> dict[str, Any]:
    match = dict(route["match"])
    match["headers"] = [*match.get("headers", []), header]
    return {**route, "name": f"{route['name']}:{header['string_match']['exact']}",
            "match": match}


def _marked(route: dict[str, Any], priority: str, retry_after: int) -> dict[str, Any]:
    action = {**route["route"], "priority": ENVOY_PRIORITY[priority]}
    metadata = {"filter_metadata": {"trimtab": {RETRY_AFTER_KEY: str(retry_after)}}}
    return {**route, "route": action, "metadata": metadata}


def admission_routes(pool: PoolConfig, routes: list[dict[str, Any]], retry_after: int
                     ) -> list[dict[str, Any]]:
    """A pool's routes with their admission priority and Retry-After: each forwarding route
    at the pool's default priority, preceded by a copy for requests whose priority header
    names the other class. Routes of a pool without admission are returned as they are."""
    if not pool.admits:
        return routes
    settings = pool.admission
    other = BATCH if settings.default_priority == INTERACTIVE else INTERACTIVE
    header = {"name": settings.priority_header, "string_match": {"exact": other}}
    out: list[dict[str, Any]] = []
    for route in routes:
        if "route" not in route:
            out.append(route)
            continue
        out.append(_marked(_with_header(route, header), other, retry_after))
        out.append(_marked(route, settings.default_priority, retry_after))
    return out
