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

**Tenant fairness** (``admission.tenant_header``): each forwarding route of the pool carries a
``local_ratelimit`` configuration with a *dynamic* descriptor, an entry with a key and no
value, so Envoy keeps one token bucket per distinct tenant (the header's value; requests
without it share one bucket, :data:`ANONYMOUS`), at most ``max_tenants``, the least recently
used dropped. Every bucket fills at the pool's tenant cap (``weight_calculator.fairness``),
which lives in the route (token buckets have no runtime override) and so changes with RDS,
by levels. The limiter counts always but refuses (429, response flag RL) only while the
runtime key ``trimtab.tenants.<cluster>.enforced`` is 100, which the layer sets while the
pool is pressed; absent, it is 0. The HCM carries the filter (no limit of its own) only
when some pool has a tenant header, so other configs' listeners do not change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from envoy.service.runtime.v3 import rtds_pb2

from weight_calculator.fairness import rate_of
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config

RUNTIME_LAYER = "trimtab-admission"
RETRY_AFTER_KEY = "retry_after"
HIGH, DEFAULT = "high", "default"
INTERACTIVE, BATCH = "interactive", "batch"
ENVOY_PRIORITY = {INTERACTIVE: "HIGH", BATCH: "DEFAULT"}
MAX_RETRY_AFTER_S = 60
TENANT_FILTER = "envoy.filters.http.local_ratelimit"
_LOCAL_RATE_LIMIT = ("type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3."
                     "LocalRateLimit")
TENANT_KEY = "tenant"  # the descriptor entry's key
ANONYMOUS = "-"  # the tenant of requests without the header
_UNLIMITED = {"max_tokens": 1_000_000_000, "tokens_per_fill": 1_000_000_000,
              "fill_interval": "1s"}
_REFILLS_PER_SECOND = 4  # a fast tenant's bucket refills about this often


@dataclass(frozen=True)
class ClusterLimits:
    """One Envoy's limits on requests in flight to one cluster."""

    interactive: int
    batch: int


@dataclass(frozen=True)
class RouteAdmission:
    """What the routes carry of admission, per pool name: the Retry-After a refusal is told
    (seconds), the tenant cap level (pools with a tenant header) and the share of new
    requests spilled to the fallback pool (per mille; pools with a fallback). Each changes in
    steps, so the routes are rebuilt rarely."""

    retry_after: Mapping[str, int] = field(default_factory=dict)
    tenants: Mapping[str, int] = field(default_factory=dict)
    spill: Mapping[str, int] = field(default_factory=dict)


NO_ADMISSION = RouteAdmission()


def runtime_key(cluster: str, priority: str) -> str:
    return f"circuit_breakers.{cluster}.{priority}.max_requests"


def tenant_enforced_key(cluster: str) -> str:
    return f"trimtab.tenants.{cluster}.enforced"


def runtime_layer(limits: Mapping[str, ClusterLimits], enforced: Iterable[str] = ()
                  ) -> rtds_pb2.Runtime:
    """The RTDS resource: one key per cluster and priority, and 100 (percent) for each
    cluster whose tenant limit is ``enforced``. A Struct is a map, and the snapshot hashes
    its deterministic serialisation, so the order does not matter."""
    runtime = rtds_pb2.Runtime(name=RUNTIME_LAYER)
    fields = runtime.layer.fields
    for cluster in sorted(limits):
        fields[runtime_key(cluster, HIGH)].number_value = limits[cluster].interactive
        fields[runtime_key(cluster, DEFAULT)].number_value = limits[cluster].batch
    for cluster in sorted(enforced):
        fields[tenant_enforced_key(cluster)].number_value = 100
    return runtime


def tenant_bucket(rate: float) -> dict[str, Any]:
    """A token bucket filling at ``rate`` requests a second: ``n`` tokens every ``n / rate``
    seconds (``n`` about a quarter of the rate, at least 1), holding a second's worth."""
    per_fill = max(1, round(rate / _REFILLS_PER_SECOND))
    interval_ms = max(50, round(1000 * per_fill / rate))  # Envoy's shortest is 50 ms
    return {"max_tokens": max(per_fill, math.ceil(rate)), "tokens_per_fill": per_fill,
            "fill_interval": f"{interval_ms // 1000}.{interval_ms % 1000:03d}s"}


def _percent(runtime_key: str, numerator: int) -> dict[str, Any]:
    return {"runtime_key": runtime_key,
            "default_value": {"numerator": numerator, "denominator": "HUNDRED"}}


def tenant_limit(pool: PoolConfig, level: int) -> dict[str, Any]:
    """The route's ``local_ratelimit`` configuration: a bucket per tenant at the cap
    ``rate_of(level)``, refusing only while the pool's enforced key is on; the default
    bucket (requests no descriptor matched) never runs out."""
    header = (pool.admission.tenant_header or "").lower()
    named = {"request_headers": {"header_name": header, "descriptor_key": TENANT_KEY}}
    anonymous = {"header_value_match": {
        "descriptor_key": TENANT_KEY, "descriptor_value": ANONYMOUS, "expect_match": False,
        "headers": [{"name": header, "present_match": True}]}}
    return {
        "@type": _LOCAL_RATE_LIMIT,
        "stat_prefix": f"trimtab_tenants_{pool.name}",
        "token_bucket": _UNLIMITED,
        "filter_enabled": _percent(f"trimtab.tenants.{pool.name}.enabled", 100),
        "filter_enforced": _percent(tenant_enforced_key(pool.name), 0),
        "descriptors": [{"entries": [{"key": TENANT_KEY}],
                         "token_bucket": tenant_bucket(rate_of(level))}],
        "rate_limits": [{"actions": [named]}, {"actions": [anonymous]}],
        "max_dynamic_descriptors": pool.admission.max_tenants,
        "always_consume_default_token_bucket": False,
    }


def tenant_filter(config: Config) -> dict[str, Any] | None:
    """The HCM's ``local_ratelimit`` filter (no limit of its own: each route carries its
    pool's), when some admitting pool has a tenant header."""
    if not any(pool.admits and pool.admission.tenant_header for pool in config.pools):
        return None
    return {"name": TENANT_FILTER,
            "typed_config": {"@type": _LOCAL_RATE_LIMIT, "stat_prefix": "trimtab_tenants"}}


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


def _marked(route: dict[str, Any], priority: str, retry_after: int,
            tenants: dict[str, Any] | None) -> dict[str, Any]:
    action = {**route["route"], "priority": ENVOY_PRIORITY[priority]}
    metadata = {"filter_metadata": {"trimtab": {RETRY_AFTER_KEY: str(retry_after)}}}
    marked = {**route, "route": action, "metadata": metadata}
    if tenants is not None:
        marked["typed_per_filter_config"] = {**route.get("typed_per_filter_config", {}),
                                             TENANT_FILTER: tenants}
    return marked


def admission_routes(pool: PoolConfig, routes: list[dict[str, Any]], retry_after: int,
                     tenant_level: int | None = None) -> list[dict[str, Any]]:
    """A pool's routes with their admission priority and Retry-After: each forwarding route
    at the pool's default priority, preceded by a copy for requests whose priority header
    names the other class; with a tenant header and a cap (``tenant_level``, None while the
    pool has no budget), each also carries the tenant limit. Routes of a pool without
    admission are returned as they are."""
    if not pool.admits:
        return routes
    settings = pool.admission
    other = BATCH if settings.default_priority == INTERACTIVE else INTERACTIVE
    header = {"name": settings.priority_header, "string_match": {"exact": other}}
    tenants = (tenant_limit(pool, tenant_level)
               if settings.tenant_header and tenant_level is not None else None)
    out: list[dict[str, Any]] = []
    for route in routes:
        if "route" not in route:
            out.append(route)
            continue
        out.append(_marked(_with_header(route, header), other, retry_after, tenants))
        out.append(_marked(route, settings.default_priority, retry_after, tenants))
    return out
