"""LDS and RDS: the listener and the model routes, done natively in Envoy.

* `envoy.filters.http.json_to_metadata` copies the JSON body's ``model`` into dynamic metadata
  (namespace ``trimtab``) and clears the route cache itself (checked against Envoy 1.40), so the
  routes below are re-matched once the body is read.
* An ``x-model`` header wins over the body: header routes come first.
* An unknown model gets 404 with an OpenAI-style JSON error, not a 503.
* With one pool, a request without any model goes to it; with several it gets 400.
* Before all of these, the OpenAI edges Envoy answers itself (:mod:`.openai_edges`): a body
  sent as JSON that does not parse (400), ``GET /v1/models`` and ``GET /v1/models/{id}``.
* Routes never time out a stream (``timeout: 0s``); a stream idle for 5 minutes is closed.

These depend on the config only, so they are built once per config, not per tick.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2  # noqa: F401
from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.retry.priority.previous_priorities.v3 import (  # noqa: F401
    previous_priorities_config_pb2,
)
from google.protobuf import json_format

from xds_server.config.addresses import parse_host_port
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.envoy import openai_edges, request_features
from xds_server.envoy.admission import (
    NO_ADMISSION,
    RouteAdmission,
    admission_routes,
    tenant_filter,
)
from xds_server.envoy.local_replies import local_reply_config
from xds_server.envoy.prompt_classes import AutoClass

LISTENER_NAME = "trimtab-listener"
ROUTE_CONFIG_NAME = "trimtab-routes"
METADATA_NAMESPACE = "trimtab"
MODEL_HEADER = "x-model"
ROUTE_IDLE_TIMEOUT = "300s"
MAX_BODY_BYTES = 8 * 1024 * 1024  # json_to_metadata buffers the body; long prompts are large
_FILTERS = "type.googleapis.com/envoy.extensions.filters"
_JSON_CONTENT_TYPE = openai_edges.JSON_CONTENT_TYPES
_PREVIOUS_HOSTS = ("type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                   "PreviousHostsPredicate")
_PREVIOUS_PRIORITIES = ("type.googleapis.com/envoy.extensions.retry.priority.previous_priorities."
                        "v3.PreviousPrioritiesConfig")


CANARY_HEADER = "x-canary-version"
_MAX_INT64 = 2**63 - 1


def _retry_policy(pool: PoolConfig) -> dict[str, Any]:
    retry = pool.retry_policy
    policy: dict[str, Any] = {
        "retry_on": ",".join(retry.retry_on),
        "num_retries": retry.num_retries,
        "retriable_status_codes": retry.retriable_status_codes,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                  "typed_config": {"@type": _PREVIOUS_HOSTS}}],
        "host_selection_retry_max_attempts": 5,
    }
    if retry.per_try_timeout_seconds > 0:
        policy["per_try_timeout"] = _seconds(retry.per_try_timeout_seconds)
    if pool.fallback is not None:
        # The aggregate cluster is [pool, fallback] as priorities. Until health checks or
        # ejection notice that the pool's hosts are down, Envoy would pick the pool again for
        # every retry; skipping the priorities already tried sends the retry to the fallback.
        policy["retry_priority"] = {"name": "envoy.retry_priorities.previous_priorities",
                                    "typed_config": {"@type": _PREVIOUS_PRIORITIES,
                                                     "update_frequency": 1}}
    return policy


def _seconds(value: float) -> str:
    return f"{value:.3f}s"


def _action(pool: PoolConfig, canary_percent: float, version: str | None = None,
            spill: int = 0) -> dict[str, Any]:
    """Where a request for `pool` goes: its stable cluster (through the fallback aggregate when
    there is one), split with the canary by `canary_percent`, or the version a header forces.
    ``spill`` (per mille, admission): the share of the stable traffic sent straight to the
    fallback pool while the pool is over its budget."""
    stable = pool.fallback_cluster if pool.fallback is not None else pool.name
    action: dict[str, Any] = {
        "timeout": _seconds(pool.timeouts.request_seconds),
        "idle_timeout": _seconds(pool.timeouts.idle_seconds),
        "retry_policy": _retry_policy(pool),
    }
    parts = _stable_parts(pool, stable, spill)
    share = round(canary_percent * 10)  # per mille, so fractional percents survive
    if version == "canary" or (version is None and pool.versions and share >= 1000):
        action["cluster"] = pool.canary_cluster
    elif version == "stable" or not pool.versions or share <= 0:
        _target(action, parts)
    else:  # the stable side's parts share what the canary leaves
        _target(action, [*((name, w * (1000 - share) // 1000) for name, w in parts),
                         (pool.canary_cluster, share)])
    if pool.affinity is not None:
        action["hash_policy"] = [{"header": {"header_name": pool.affinity.header}}]
    return action


def _stable_parts(pool: PoolConfig, stable: str, spill: int) -> list[tuple[str, int]]:
    """The stable target, or (while admission spills) it and the fallback pool, per mille."""
    if pool.fallback is None or spill <= 0:
        return [(stable, 1000)]
    spill = min(1000, spill)
    return [(stable, 1000 - spill), (pool.fallback, spill)]


def _target(action: dict[str, Any], parts: list[tuple[str, int]]) -> None:
    """One cluster, or weighted clusters (parts of weight 0 left out)."""
    parts = [(name, weight) for name, weight in parts if weight > 0]
    if len(parts) == 1:
        action["cluster"] = parts[0][0]
        return
    action["weighted_clusters"] = {"clusters": [{"name": name, "weight": weight}
                                                for name, weight in parts]}


def _json_error(name: str, match: dict[str, Any], status: int, code: str, message: str
                ) -> dict[str, Any]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": code}}, sort_keys=True)
    return {
        "name": name,
        "match": {"prefix": "/", **match},
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [{
            "header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }


def _model_match(source: str, model: str, extra_headers: list[dict[str, Any]]) -> dict[str, Any]:
    if source == "header":
        header = {"name": MODEL_HEADER, "string_match": {"exact": model}}
        return {"prefix": "/", "headers": [header, *extra_headers]}
    metadata = [{"filter": METADATA_NAMESPACE, "path": [{"key": "model"}],
                 "value": {"string_match": {"exact": model}}}]
    match: dict[str, Any] = {"prefix": "/", "dynamic_metadata": metadata}
    if extra_headers:
        match["headers"] = extra_headers
    return match


def _auto_action(pool: PoolConfig, cls: AutoClass) -> dict[str, Any]:
    """A derived class goes straight to its cluster (no canary split, no fallback)."""
    action = _action(pool, 0.0)
    action.pop("weighted_clusters", None)
    action["retry_policy"].pop("retry_priority", None)
    action["cluster"] = cls.cluster
    return action


def _retry_after(config: Config, pool: PoolConfig, admission: RouteAdmission) -> int:
    """The pool's predicted Retry-After, else the configured one (at least 1 s)."""
    default = max(1, config.listener.local_replies.retry_after_seconds)
    return admission.retry_after.get(pool.name, default)


def _pool_routes(config: Config, pool: PoolConfig, source: str,
                 canary: Mapping[str, float],
                 auto: Sequence[AutoClass] = (),
                 admission: RouteAdmission = NO_ADMISSION) -> list[dict[str, Any]]:
    """Routes for one pool's model: forced canary versions, prompt-size classes, then plain."""
    routes = []
    percent = canary.get(pool.name, 0.0)
    spill = admission.spill.get(pool.name, 0)
    routes += request_features.version_routes(config, pool, source,
                                              _model_match(source, pool.model, []),
                                              _action(pool, percent, "stable", spill))
    if pool.versions is not None:
        for version in ("canary", "stable"):
            forced = {"name": CANARY_HEADER, "string_match": {"exact": version}}
            routes.append({"name": f"{source}:{pool.name}:{version}",
                           "match": _model_match(source, pool.model, [forced]),
                           "route": _action(pool, percent, version, spill)})
    routes += request_features.class_routes(
        pool, source, _model_match(source, pool.model, []),
        lambda name: _action(config.pool(name), canary.get(name, 0.0)))
    for index, size in enumerate(pool.size_classes()):
        target = config.pool(size.pool)
        length = {"name": "content-length",
                  "range_match": {"start": size.min_prompt_bytes, "end": size.upper}}
        routes.append({"name": f"{source}:{pool.name}:size{index}",
                       "match": _model_match(source, pool.model, [length]),
                       "route": _action(target, canary.get(target.name, 0.0))})
    for index, cls in enumerate(auto):
        length = {"name": "content-length",
                  "range_match": {"start": cls.min_prompt_bytes, "end": cls.upper}}
        routes.append({"name": f"{source}:{pool.name}:auto{index}",
                       "match": _model_match(source, pool.model, [length]),
                       "route": _auto_action(pool, cls)})
    routes.append({"name": f"{source}:{pool.name}", "match": _model_match(source, pool.model, []),
                   "route": _action(pool, percent, spill=spill)})
    wait = _retry_after(config, pool, admission)
    level = admission.tenants.get(pool.name)
    routes = admission_routes(pool, routes, wait, level)
    if source == "body":  # the body parsed as JSON, whatever content type the client sent
        for route in routes:
            if "route" in route:
                route["request_headers_to_add"] = openai_edges.content_type_json()
    return request_features.scope_classifier(config, pool, routes)


def model_routes(config: Config, canary: Mapping[str, float] | None = None,
                 auto: Mapping[str, Sequence[AutoClass]] | None = None,
                 admission: RouteAdmission = NO_ADMISSION) -> list[dict[str, Any]]:
    """Header routes, then body routes, then the unknown-model and no-model answers.
    ``auto``: each pool's derived prompt-size classes (``long_context: auto``);
    ``admission``: what admitting pools' routes carry (envoy/admission.py)."""
    canary = canary or {}
    auto = auto or {}
    routable = [pool for pool in config.pools if pool.name not in _class_only(config)]
    routes = [openai_edges.invalid_body_route(), *openai_edges.models_routes(config)]
    for pool in routable:
        routes += _pool_routes(config, pool, "header", canary, auto.get(pool.name, ()),
                               admission)
    present = {"headers": [{"name": MODEL_HEADER, "present_match": True}]}
    routes.append(_json_error("header:unknown", present, 404, "model_not_found",
                              "The model in the x-model header is not served here."))
    # (local_replies rewrites these 404s to name the model: openai_edges.not_found_mappers)
    for pool in routable:
        routes += _pool_routes(config, pool, "body", canary, auto.get(pool.name, ()),
                               admission)
    unknown = {"dynamic_metadata": [{"filter": METADATA_NAMESPACE, "path": [{"key": "model"}],
                                     "value": {"present_match": True}}]}
    routes.append(_json_error("body:unknown", unknown, 404, "model_not_found",
                              "The requested model is not served here."))
    if len(routable) == 1:
        only = routable[0]
        wait = _retry_after(config, only, admission)
        action = _action(only, canary.get(only.name, 0.0), spill=admission.spill.get(only.name, 0))
        routes += admission_routes(only, [{"name": "default", "match": {"prefix": "/"},
                                           "route": action}],
                                   wait, admission.tenants.get(only.name))
    else:
        routes.append(_json_error("no-model", {}, 400, "model_required",
                                  "Name a model in the JSON body or the x-model header."))
    return routes


def _class_only(config: Config) -> set[str]:
    """Pools that only serve another pool's size class and share its model name."""
    models = {pool.name: pool.model for pool in config.pools}
    return {size.pool for pool in config.pools for size in pool.size_classes()
            if models.get(size.pool) == pool.model} | request_features.same_model_targets(config)


def build_route_config(config: Config, canary: Mapping[str, float] | None = None,
                       auto: Mapping[str, Sequence[AutoClass]] | None = None,
                       admission: RouteAdmission = NO_ADMISSION
                       ) -> route_pb2.RouteConfiguration:
    document = {"name": ROUTE_CONFIG_NAME, "virtual_hosts": [
        {"name": "models", "domains": ["*"], "routes": request_features.disable_classifier_elsewhere(
            config, model_routes(config, canary, auto, admission))}]}
    return json_format.ParseDict(document, route_pb2.RouteConfiguration())


def http_filters(config: Config | None = None) -> list[dict[str, Any]]:
    rule = {"selectors": [{"key": "model"}],
            "on_present": {"metadata_namespace": METADATA_NAMESPACE, "key": "model",
                           "type": "STRING"},
            "on_error": openai_edges.on_error()}  # not JSON: routes answer 400
    extra = request_features.json_rules(config) if config is not None else []
    lua = request_features.lua_filter(config) if config is not None else None
    hop = request_features.ext_proc_filter(config) if config is not None else None
    tenants = tenant_filter(config) if config is not None else None
    json_to_metadata = {
        "@type": f"{_FILTERS}.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {"rules": [rule, *extra],
                          "allow_content_types_regex": {"regex": _JSON_CONTENT_TYPE},
                          "allow_empty_content_type": True},
    }
    return [
        {"name": "envoy.filters.http.json_to_metadata", "typed_config": json_to_metadata},
        *([lua] if lua is not None else []),
        *([hop] if hop is not None else []),
        *([tenants] if tenants is not None else []),  # after the route is final
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": f"{_FILTERS}.http.router.v3.Router"}},
    ]


def build_listener(config: Config) -> listener_pb2.Listener:
    host_port = parse_host_port(config.listener.address)
    hcm = {
        "@type": f"{_FILTERS}.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "trimtab",
        "codec_type": "AUTO",
        "rds": {"route_config_name": ROUTE_CONFIG_NAME,
                "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": http_filters(config),
        "local_reply_config": local_reply_config(config),
        "request_timeout": "0s",  # LLM requests stream for minutes
        "stream_idle_timeout": ROUTE_IDLE_TIMEOUT,
    }
    document = {
        "name": LISTENER_NAME,
        "address": {"socket_address": {"address": host_port.host, "port_value": host_port.port}},
        "per_connection_buffer_limit_bytes": MAX_BODY_BYTES,
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }
    listener = json_format.ParseDict(document, listener_pb2.Listener())
    # ParseDict packs the HCM without sorting maps (the local replies' json_format is a
    # Struct): pack it again deterministically so every replica gives the same bytes.
    packed = listener.filter_chains[0].filters[0].typed_config
    manager = http_connection_manager_pb2.HttpConnectionManager()
    packed.Unpack(manager)
    packed.Pack(manager, deterministic=True)
    return listener
