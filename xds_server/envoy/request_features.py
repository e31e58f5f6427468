"""Route on what a request asks for, natively in Envoy (no per-request hop to Python).

* **Generation and sampling** (`max_tokens`/`max_completion_tokens`, `stream`, `n`,
  `temperature`): extra json_to_metadata rules copy them into dynamic metadata (namespace
  ``trimtab``) as numbers or booleans; a pool's ``request_classes`` become routes whose
  ``dynamic_metadata`` matchers test ranges of them. A field the request lacks writes nothing,
  so no range matches it and the request takes the pool's default route.
* **Modality**: a Lua filter looks at the first ``listener.modality_inspect_bytes`` of the
  buffered body for content parts of type ``image_url``/``input_image`` (image) or
  ``input_audio`` (audio), writes ``trimtab.modality`` and clears the route cache. A body
  without such a part in that prefix writes nothing: the default route, never an error.
* **Answers when nothing can serve**: see :mod:`.local_replies`.

Each filter or rule is added only when some pool uses it, so a config without these keys
keeps the listener it had (apart from the JSON local replies). Measured facts: see
docs/envoy-routing-notes.md ("Request features").
"""

from __future__ import annotations

from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401 - registers
from envoy.extensions.filters.http.lua.v3 import lua_pb2  # noqa: F401 - registers the type
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format

from xds_server.config.pools import NumberRangeConfig, PoolConfig, RequestClassConfig
from xds_server.config.schema import Config

NAMESPACE = "trimtab"
CLASSIFIER_NAMESPACE = "trimtab.classifier"  # only the ext_proc filter writes it
CLASSIFIER_CLUSTER = "trimtab-classifier"
TIER_HEADER = "x-trimtab-tier"  # set for the upstream to see; routes match the metadata
EXT_PROC = "envoy.filters.http.ext_proc"
LUA = "envoy.filters.http.lua"
MODEL_HEADER = "x-model"
_FILTERS = "type.googleapis.com/envoy.extensions.filters"
_FAR = 1e300  # an open end of a DoubleRange
_PRIORITIES = {"name": "envoy.retry_priorities.previous_priorities",
               "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.priority."
                                         "previous_priorities.v3.PreviousPrioritiesConfig",
                                "update_frequency": 1}}
# Body field -> (metadata key, json_to_metadata type). Later rules overwrite earlier ones, so
# max_completion_tokens (OpenAI's current name) wins over max_tokens when both are present.
_GENERATION_RULES: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_tokens", "NUMBER"),
    "max_completion_tokens": ("max_tokens", "NUMBER"),
    "stream": ("stream", "PROTOBUF_VALUE"),  # keeps a JSON bool a bool; "false" matches nothing
    "n": ("n", "NUMBER"),
    "temperature": ("temperature", "NUMBER"),
}
_FEATURE_OF_KEY = {"max_tokens": "max_tokens", "stream": "stream", "n": "n",
                   "temperature": "temperature"}


# -- generation and sampling ------------------------------------------------------------------


def _classes(config: Config) -> list[RequestClassConfig]:
    return [cls for pool in config.pools for cls in pool.request_classes]


def json_rules(config: Config) -> list[dict[str, Any]]:
    """Extra json_to_metadata request rules for the features some pool routes on."""
    used = {key for cls in _classes(config) for key in _FEATURE_OF_KEY
            if getattr(cls, key) is not None}
    return [{"selectors": [{"key": field}],
             "on_present": {"metadata_namespace": NAMESPACE, "key": key, "type": kind}}
            for field, (key, kind) in _GENERATION_RULES.items() if key in used
            ] + version_rules(config)


def _range(key: str, bounds: NumberRangeConfig) -> dict[str, Any]:
    start = bounds.min if bounds.min is not None else -_FAR
    end = bounds.max if bounds.max is not None else _FAR
    return _metadata(key, {"double_match": {"range": {"start": start, "end": end}}})


def _metadata(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"filter": NAMESPACE, "path": [{"key": key}], "value": value}


def class_matchers(cls: RequestClassConfig) -> list[dict[str, Any]]:
    """The route's dynamic_metadata matchers for one request class (all must hold)."""
    matchers = []
    if cls.modality is not None:
        matchers.append(_metadata("modality", {"string_match": {"exact": cls.modality}}))
    for key in ("max_tokens", "n", "temperature"):
        bounds = getattr(cls, key)
        if bounds is not None:
            matchers.append(_range(key, bounds))
    if cls.stream is not None:
        matchers.append(_metadata("stream", {"bool_match": cls.stream}))
    return matchers


def class_routes(pool: PoolConfig, source: str, model_match: dict[str, Any],
                 action_of: Any) -> list[dict[str, Any]]:
    """One route per request class of `pool`: the model match plus the class's matchers.
    `action_of(target_pool_name)` builds the route action (routing.py's `_action`)."""
    routes = []
    for index, cls in enumerate(pool.request_classes):
        match = dict(model_match)
        match["dynamic_metadata"] = [*model_match.get("dynamic_metadata", []),
                                     *class_matchers(cls)]
        routes.append({"name": f"{source}:{pool.name}:class{index}", "match": match,
                       "route": action_of(cls.pool)})
    for tier, target in (pool.intent_tiers or {}).items():
        match = dict(model_match)
        match["dynamic_metadata"] = [*model_match.get("dynamic_metadata", []), {
            "filter": CLASSIFIER_NAMESPACE, "path": [{"key": "tier"}],
            "value": {"string_match": {"exact": tier}}}]
        routes.append({"name": f"{source}:{pool.name}:tier:{tier}", "match": match,
                       "route": action_of(target)})
    return routes


def same_model_targets(config: Config) -> set[str]:
    """Pools that only serve another pool's request class or model version and share its
    model name (they get no model routes of their own)."""
    models = {pool.name: pool.model for pool in config.pools}
    return {target for pool in config.pools for target in pool.request_targets()
            if models.get(target) == pool.model}


# -- model versions ---------------------------------------------------------------------------


def version_cluster(pool: PoolConfig, target: str) -> str:
    """The aggregate cluster [target, pool (, pool's fallback)]; pool names never start with
    the reserved 'trimtab-', so this cannot clash with a pool's cluster."""
    return f"trimtab-version-{pool.name}-{target}"


def version_members(pool: PoolConfig, target: str) -> list[str]:
    return [target, pool.name, *([pool.fallback] if pool.fallback is not None else [])]


def version_clusters(pool: PoolConfig) -> list[str]:
    if pool.model_versions is None:
        return []
    return sorted({version_cluster(pool, t) for t in pool.model_versions.pools.values()})


def version_routes(config: Config, pool: PoolConfig, source: str,
                   model_match: dict[str, Any], action: dict[str, Any]) -> list[dict[str, Any]]:
    """Per version label: one route for the header, one for the body field. `action` is the
    pool's stable route action; the cluster becomes the version's aggregate, retries skip the
    priority (member) already tried, and sessions hash by the version pool's affinity header
    (else the pool's), so a session stays within its version."""
    versions = pool.model_versions
    if versions is None:
        return []
    routes = []
    for label, target in versions.pools.items():
        forward = {key: value for key, value in action.items()
                   if key not in ("cluster", "weighted_clusters", "hash_policy")}
        forward["cluster"] = version_cluster(pool, target)
        forward["retry_policy"] = {**action["retry_policy"], "retry_priority": _PRIORITIES}
        affinity = config.pool(target).affinity or pool.affinity
        if affinity is not None:
            forward["hash_policy"] = [{"header": {"header_name": affinity.header}}]
        by_header = {**model_match, "headers": [*model_match.get("headers", []), {
            "name": versions.header, "string_match": {"exact": label}}]}
        routes.append({"name": f"{source}:{pool.name}:version:{label}", "match": by_header,
                       "route": forward})
        if versions.body_field is not None:
            by_body = {**model_match, "dynamic_metadata": [
                *model_match.get("dynamic_metadata", []),
                _metadata("model_version", {"string_match": {"exact": label}})]}
            routes.append({"name": f"{source}:{pool.name}:version-body:{label}",
                           "match": by_body, "route": forward})
    return routes


def version_rules(config: Config) -> list[dict[str, Any]]:
    fields = sorted({pool.model_versions.body_field for pool in config.pools
                     if pool.model_versions is not None and pool.model_versions.body_field})
    return [{"selectors": [{"key": field}],
             "on_present": {"metadata_namespace": NAMESPACE, "key": "model_version",
                            "type": "STRING"}} for field in fields]


# -- modality ---------------------------------------------------------------------------------

# Content parts are JSON objects with "type": "<kind>". A text part that merely mentions such
# a type has its quotes escaped (\"type\"), which this pattern does not match.
_LUA = """
local LIMIT = %(limit)d
local IMAGE = {'"type"%%s*:%%s*"image_url"', '"type"%%s*:%%s*"input_image"'}
local AUDIO = {'"type"%%s*:%%s*"input_audio"'}
local function any(text, patterns)
  for _, pattern in ipairs(patterns) do
    if string.find(text, pattern) then return true end
  end
  return false
end
function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then return end
  local size = body:length()
  if size == 0 then return end
  if size > LIMIT then size = LIMIT end
  local text = body:getBytes(0, size)
  -- the common text-only case: two plain searches, no pattern machinery
  if not string.find(text, "image", 1, true) and not string.find(text, "audio", 1, true) then
    return
  end
  local kind = nil
  if any(text, IMAGE) then kind = "image" elseif any(text, AUDIO) then kind = "audio" end
  if kind ~= nil then
    handle:streamInfo():dynamicMetadata():set("%(namespace)s", "modality", kind)
    handle:clearRouteCache()
  end
end
"""


def lua_filter(config: Config) -> dict[str, Any] | None:
    """The modality filter, or None when no pool routes on modality."""
    if not any(cls.modality is not None for cls in _classes(config)):
        return None
    source = _LUA % {"limit": config.listener.modality_inspect_bytes, "namespace": NAMESPACE}
    return {"name": LUA,
            "typed_config": {"@type": f"{_FILTERS}.http.lua.v3.Lua",
                             "default_source_code": {"inline_string": source}}}


# -- answers when nothing can serve -----------------------------------------------------------

# -- intent tiers (the `trimtab classify` ext_proc hop) ---------------------------------------


def classifier_used(config: Config) -> bool:
    return config.classifier is not None and any(pool.intent_tiers for pool in config.pools)


def ext_proc_filter(config: Config) -> dict[str, Any] | None:
    """The classifier hop, or None. It runs after json_to_metadata has read the body and
    re-matched the route, so the per-route switch (`scope_classifier`) sees the pool's route.
    Headers are sent too: with them skipped Envoy does not hold the request for the body's
    answer. Fails open: a timeout or an error continues to the pool's default route."""
    if not classifier_used(config):
        return None
    classifier = config.classifier
    assert classifier is not None
    typed = {
        "@type": f"{_FILTERS}.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": CLASSIFIER_CLUSTER}},
        "failure_mode_allow": True,
        "message_timeout": f"{classifier.message_timeout_ms / 1000:.3f}s",
        "stat_prefix": "classifier",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SKIP",
                            "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        "metadata_options": {"receiving_namespaces": {"untyped": [CLASSIFIER_NAMESPACE]}},
        # the service may set its tier header and nothing else
        "mutation_rules": {"allow_expression": {"regex": f"^{TIER_HEADER}$"},
                           "disallow_system": True},
    }
    return {"name": EXT_PROC, "typed_config": typed}


_EXT_PROC_ROUTE = f"{_FILTERS}.http.ext_proc.v3.ExtProcPerRoute"


_LUA_ROUTE = f"{_FILTERS}.http.lua.v3.LuaPerRoute"
_INSPECTS = "_trimtab_inspects"  # a marker on the route dicts of modality pools (removed below)


def scope_classifier(config: Config, pool: PoolConfig, routes: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    """Routes of a pool with intent tiers take the hop, routes of a pool with a modality class
    run the Lua filter; `disable_classifier_elsewhere` turns both off on every other route
    (both filters look their per-route config up after json_to_metadata re-matched the
    route, so it is the pool's route they see)."""
    if classifier_used(config) and pool.intent_tiers:
        for route in routes:
            route.setdefault("typed_per_filter_config", {})[EXT_PROC] = {
                "@type": _EXT_PROC_ROUTE, "overrides": {"failure_mode_allow": True}}
    if any(cls.modality is not None for cls in pool.request_classes):
        for route in routes:
            route[_INSPECTS] = True
    return routes


def disable_classifier_elsewhere(config: Config, routes: list[dict[str, Any]]
                                 ) -> list[dict[str, Any]]:
    lua = lua_filter(config) is not None
    for route in routes:
        per_filter = route.setdefault("typed_per_filter_config", {})
        if classifier_used(config) and EXT_PROC not in per_filter:
            per_filter[EXT_PROC] = {"@type": _EXT_PROC_ROUTE, "disabled": True}
        if lua and not route.pop(_INSPECTS, False):
            per_filter[LUA] = {"@type": _LUA_ROUTE, "disabled": True}
        route.pop(_INSPECTS, None)
        if not per_filter:
            del route["typed_per_filter_config"]
    return routes


def extra_clusters(config: Config) -> list[cluster_pb2.Cluster]:
    """The classifier's cluster (HTTP/2, static address) when some pool uses it."""
    if not classifier_used(config):
        return []
    assert config.classifier is not None
    where = config.classifier.dial_address  # the embedded classifier, or `trimtab classify`
    endpoint = {"endpoint": {"address": {"socket_address": {"address": where.host,
                                                            "port_value": where.port}}}}
    options = http_protocol_options_pb2.HttpProtocolOptions()
    options.explicit_http_config.http2_protocol_options.SetInParent()
    document = {
        "name": CLASSIFIER_CLUSTER, "type": "STATIC", "connect_timeout": "0.250s",
        "load_assignment": {"cluster_name": CLASSIFIER_CLUSTER,
                            "endpoints": [{"lb_endpoints": [endpoint]}]},
        # a full classifier fails requests open, never queues them
        "circuit_breakers": {"thresholds": [{"max_connections": 100_000,
                                             "max_pending_requests": 100_000,
                                             "max_requests": 100_000}]},
    }
    cluster = json_format.ParseDict(document, cluster_pb2.Cluster())
    cluster.typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Pack(options, deterministic=True)
    return [cluster]


def extra_cluster_names(config: Config) -> set[str]:
    return {CLASSIFIER_CLUSTER} if classifier_used(config) else set()
