"""The Envoy bootstraps and the trimtab config that the benchmark runs each policy with.

Pure functions: fleet addresses and ports in, plain dicts out (YAML-ready). Every policy gets
the same listener and the same cluster settings except the balancer:

* ``round_robin`` / ``least_request``: a STATIC cluster with Envoy's ``lb_policy`` (least
  request is Envoy's default: power of two choices with equal weights).
* ``cswrr_orca``: the same STATIC cluster with ``load_balancing_policy``
  ``envoy.load_balancing_policies.client_side_weighted_round_robin``, which weighs each host by
  ``rps_fractional / utilization`` from the ORCA ``endpoint-load-metrics`` response header that
  the simulator sends (see :data:`CSWRR_SETTINGS` for the values we picked and why).
* ``trimtab``: Envoy takes CDS/EDS/LDS/RDS over ADS from ``trimtab serve``, run on
  :func:`trimtab_config`: one pool of the fleet's endpoints, ``lb_policy: least_request`` and
  trimtab's weights.
* ``reference``: the same, with the issue's reference controller as the weight policy
  (weight = capacity x (1 - KV use), scraped every 2 s; see :mod:`.reference`).

Shared settings (so no baseline is capped by Envoy's defaults): circuit breakers at 100000
(Envoy's default is 1024 requests per cluster), route ``timeout: 0s`` (Envoy's default 15 s
resets long streams, see docs/simulator.md) with a 300 s stream idle timeout, HTTP/1.1 upstream
connections kept for an hour of idleness, 2 s connect timeout. trimtab's generated cluster also
carries its retry policy and outlier detection; the simulator answers no errors unless faults
are configured, so those stay idle in these runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trimtab_dev.envoy_process import render_bootstrap

POLICIES: tuple[str, ...] = ("round_robin", "least_request", "cswrr_orca", "reference",
                             "trimtab")
BASELINE = "least_request"
REFERENCE = "reference"
XDS_POLICIES = frozenset({"trimtab", REFERENCE})  # served by ``trimtab serve`` over ADS
CLUSTER = "fleet"  # the static cluster's name, and the trimtab pool's
CIRCUIT_LIMIT = 100_000
IDLE_TIMEOUT = "300s"
UPSTREAM_IDLE_TIMEOUT = "3600s"
CONNECT_TIMEOUT = "2s"

_FILTERS = "type.googleapis.com/envoy.extensions.filters"
_HCM = f"{_FILTERS}.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = f"{_FILTERS}.http.router.v3.Router"
_HTTP_OPTIONS_NAME = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_HTTP_OPTIONS = f"type.googleapis.com/{_HTTP_OPTIONS_NAME}"
CSWRR_NAME = "envoy.load_balancing_policies.client_side_weighted_round_robin"
_CSWRR_TYPE = ("type.googleapis.com/envoy.extensions.load_balancing_policies."
               "client_side_weighted_round_robin.v3.ClientSideWeightedRoundRobin")

# client_side_weighted_round_robin (xds-protos envoy.extensions.load_balancing_policies.
# client_side_weighted_round_robin.v3). Defaults (gRPC's and Envoy's): blackout 10 s, weight
# update 1 s, expiration 3 min, error penalty 1.0.
CSWRR_SETTINGS: dict[str, Any] = {
    # Per-request reports ride on response headers; there is no out-of-band ORCA service.
    "enable_oob_load_report": False,
    # A host's weight is used only once its reports are this old: the 10 s default would
    # spend the whole warm-up of a short run at equal weights. 2 s still skips the first,
    # noisiest reports (rps_fractional is a 10 s window in the simulator).
    "blackout_period": "2s",
    # Recompute the weights every second (the default), well under the telemetry tick.
    "weight_update_period": "1s",
    # A host without reports for 3 min falls back to the mean weight (the default): a slow
    # host that gets little traffic still reports often enough to keep its own weight.
    "weight_expiration_period": "180s",
    # weight = qps / (utilization + eps/qps * penalty): 1.0 (the default) counts errors.
    "error_utilization_penalty": 1.0,
}


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def listener(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """One HTTP listener routing everything to :data:`CLUSTER`, streams never timed out."""
    route = {"match": {"prefix": "/"},
             "route": {"cluster": CLUSTER, "timeout": "0s", "idle_timeout": IDLE_TIMEOUT}}
    hcm = {"@type": _HCM, "stat_prefix": "bench", "codec_type": "AUTO",
           "request_timeout": "0s", "stream_idle_timeout": IDLE_TIMEOUT,
           "route_config": {"name": "bench", "virtual_hosts": [
               {"name": "fleet", "domains": ["*"], "routes": [route]}]},
           "http_filters": [{"name": "envoy.filters.http.router",
                             "typed_config": {"@type": _ROUTER}}]}
    return {"name": "bench", "address": _socket(host, port), "filter_chains": [{"filters": [
        {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}


def circuit_breakers() -> dict[str, Any]:
    limits = {"max_connections": CIRCUIT_LIMIT, "max_pending_requests": CIRCUIT_LIMIT,
              "max_requests": CIRCUIT_LIMIT, "max_retries": CIRCUIT_LIMIT}
    return {"thresholds": [limits]}


def cswrr_policy(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``load_balancing_policy`` selecting client-side weighted round robin on ORCA reports
    (:data:`CSWRR_SETTINGS`, with ``overrides`` on top: tests shorten the blackout)."""
    config = {"@type": _CSWRR_TYPE, **CSWRR_SETTINGS, **(overrides or {})}
    return {"policies": [{"typed_extension_config": {"name": CSWRR_NAME, "typed_config": config}}]}


def static_cluster(policy: str, addresses: Sequence[str],
                   cswrr: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fleet as one STATIC cluster balanced by ``policy`` (a baseline)."""
    cluster: dict[str, Any] = {
        "name": CLUSTER, "type": "STATIC", "connect_timeout": CONNECT_TIMEOUT,
        "circuit_breakers": circuit_breakers(),
        "typed_extension_protocol_options": {_HTTP_OPTIONS_NAME: {
            "@type": _HTTP_OPTIONS,
            "common_http_protocol_options": {"idle_timeout": UPSTREAM_IDLE_TIMEOUT},
            "explicit_http_config": {"http_protocol_options": {}}}},
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(*_split(a))}} for a in addresses]}]},
    }
    if policy == "round_robin":
        cluster["lb_policy"] = "ROUND_ROBIN"
    elif policy == "least_request":
        cluster["lb_policy"] = "LEAST_REQUEST"
    elif policy == "cswrr_orca":
        cluster["load_balancing_policy"] = cswrr_policy(cswrr)
    else:
        raise ValueError(f"no static config for policy {policy!r}")
    return cluster


def static_bootstrap(policy: str, addresses: Sequence[str], *, listener_port: int,
                     admin_port: int, cswrr: Mapping[str, Any] | None = None
                     ) -> dict[str, Any]:
    """A self-contained Envoy bootstrap for a baseline policy (``cswrr``: overrides of
    :data:`CSWRR_SETTINGS` for ``cswrr_orca``)."""
    return {
        "node": {"id": f"bench-{policy}", "cluster": "bench"},
        "static_resources": {"listeners": [listener(listener_port)],
                             "clusters": [static_cluster(policy, addresses, cswrr)]},
        "admin": {"address": _socket("127.0.0.1", admin_port)},
    }


def dynamic_bootstrap(*, xds_port: int, admin_port: int) -> dict[str, Any]:
    """Envoy taking everything from trimtab over ADS (State of the World)."""
    return render_bootstrap(xds_host="127.0.0.1", xds_port=xds_port, admin_port=admin_port,
                            node_id="bench-trimtab", node_cluster="bench")


@dataclass(frozen=True)
class LongContext:
    """trimtab's prompt-size class for the run: requests of at least ``min_prompt_bytes``
    (content-length) go to a second pool made of ``addresses`` only."""

    min_prompt_bytes: int
    addresses: tuple[str, ...]


LONG_POOL = f"{CLUSTER}-long"


def _pools(model: str, addresses: Sequence[str], long_context: LongContext | str | None,
           lb_policy: str = "least_request", bias: float | None = None
           ) -> list[dict[str, Any]]:
    main: dict[str, Any] = {"name": CLUSTER, "model": model, "lb_policy": lb_policy,
                            "endpoints": [{"address": a} for a in addresses]}
    if bias is not None:
        main["active_request_bias"] = bias
    if long_context == "auto":  # classes derived from the servers' KV capacities
        main["long_context"] = "auto"
        return [main]
    if not isinstance(long_context, LongContext):
        return [main]
    main["long_context"] = {"pool": LONG_POOL,
                            "min_prompt_bytes": long_context.min_prompt_bytes}
    long_pool = {"name": LONG_POOL, "model": f"{model}#long-context",
                 "lb_policy": lb_policy,
                 "endpoints": [{"address": a} for a in long_context.addresses]}
    return [main, long_pool]


def trimtab_config(*, model: str, addresses: Sequence[str], xds_port: int, admin_port: int,
                   listener_port: int, weights: str = "queueing", interval: float = 2.0,
                   composite: Mapping[str, Any] | None = None,
                   long_context: LongContext | str | None = None,
                   lb_policy: str = "least_request",
                   queueing: Mapping[str, Any] | None = None,
                   active_request_bias: float | None = None,
                   ttft_slo_s: float | None = None,
                   tenant_header: str | None = None) -> dict[str, Any]:
    """``trimtab serve`` config: one pool of the fleet, ``lb_policy`` on trimtab's weights;
    with ``ttft_slo_s`` (the workload's), every pool's ``slo.ttft_seconds``: admission on, and
    with ``tenant_header`` too (the workload's tenants), tenant fairness.

    Capacity is left to the servers' ``vllm:cache_config_info``; staleness after three ticks
    (the product's 6 s at the default 2 s tick). ``composite`` overrides knobs of the
    composite policy (``weights.composite``), for tuning experiments. With ``long_context``,
    long prompts go to a second pool (trimtab's prompt-size classes, a ``content-length``
    range match in Envoy).
    """
    weights_section: dict[str, Any] = {"policy": weights}
    if composite:
        weights_section["composite"] = dict(composite)
    if queueing:
        weights_section["queueing"] = dict(queueing)
    pools = _pools(model, addresses, long_context, lb_policy, active_request_bias)
    if ttft_slo_s is not None:
        for pool in pools:
            pool["slo"] = {"ttft_seconds": ttft_slo_s}
            if tenant_header is not None:
                pool["admission"] = {"tenant_header": tenant_header}
    return {
        "xds": {"address": f"127.0.0.1:{xds_port}"},
        "admin": {"address": f"127.0.0.1:{admin_port}"},
        "listener": {"address": f"127.0.0.1:{listener_port}"},
        "telemetry": {"interval_seconds": interval, "stale_after_seconds": 3 * interval},
        "weights": weights_section,
        "pools": pools,
    }
