"""LDS and RDS: the listener and the model routes, done natively in Envoy.

* `envoy.filters.http.json_to_metadata` copies the JSON body's ``model`` into dynamic metadata
  (namespace ``trimtab``) and clears the route cache itself (checked against Envoy 1.40), so the
  routes below are re-matched once the body is read.
* An ``x-model`` header wins over the body: header routes come first.
* An unknown model gets 404 with an OpenAI-style JSON error, not a 503.
* With one pool, a request without any model goes to it; with several it gets 400.
* Routes never time out a stream (``timeout: 0s``); a stream idle for 5 minutes is closed.

These depend on the config only, so they are built once per config, not per tick.
"""

from __future__ import annotations

import json
from typing import Any

from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.filters.http.json_to_metadata.v3 import json_to_metadata_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from google.protobuf import json_format

from .config import Config, parse_host_port

LISTENER_NAME = "trimtab-listener"
ROUTE_CONFIG_NAME = "trimtab-routes"
METADATA_NAMESPACE = "trimtab"
MODEL_HEADER = "x-model"
ROUTE_IDLE_TIMEOUT = "300s"
MAX_BODY_BYTES = 8 * 1024 * 1024  # json_to_metadata buffers the body; long prompts are large
_FILTERS = "type.googleapis.com/envoy.extensions.filters"
_JSON_CONTENT_TYPE = r"(?i)^application/json\s*(;.*)?$"


def _forward(cluster: str) -> dict[str, Any]:
    return {"cluster": cluster, "timeout": "0s", "idle_timeout": ROUTE_IDLE_TIMEOUT}


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


def _body_model(value: dict[str, Any]) -> dict[str, Any]:
    return {"dynamic_metadata": [{"filter": METADATA_NAMESPACE, "path": [{"key": "model"}],
                                  "value": value}]}


def model_routes(config: Config) -> list[dict[str, Any]]:
    """Header routes, then body routes, then the unknown-model and no-model answers."""
    routes: list[dict[str, Any]] = []
    for pool in config.pools:
        header = {"name": MODEL_HEADER, "string_match": {"exact": pool.model}}
        routes.append({"name": f"header:{pool.name}", "match": {"prefix": "/", "headers": [header]},
                       "route": _forward(pool.name)})
    present = {"headers": [{"name": MODEL_HEADER, "present_match": True}]}
    routes.append(_json_error("header:unknown", present, 404, "model_not_found",
                              "The model in the x-model header is not served here."))
    for pool in config.pools:
        routes.append({"name": f"body:{pool.name}",
                       "match": {"prefix": "/", **_body_model({"string_match": {"exact": pool.model}})},
                       "route": _forward(pool.name)})
    routes.append(_json_error("body:unknown", _body_model({"present_match": True}), 404,
                              "model_not_found", "The requested model is not served here."))
    if len(config.pools) == 1:
        routes.append({"name": "default", "match": {"prefix": "/"},
                       "route": _forward(config.pools[0].name)})
    else:
        routes.append(_json_error("no-model", {}, 400, "model_required",
                                  "Name a model in the JSON body or the x-model header."))
    return routes


def build_route_config(config: Config) -> route_pb2.RouteConfiguration:
    document = {"name": ROUTE_CONFIG_NAME, "virtual_hosts": [
        {"name": "models", "domains": ["*"], "routes": model_routes(config)}]}
    return json_format.ParseDict(document, route_pb2.RouteConfiguration())


def http_filters() -> list[dict[str, Any]]:
    rule = {"selectors": [{"key": "model"}],
            "on_present": {"metadata_namespace": METADATA_NAMESPACE, "key": "model",
                           "type": "STRING"}}
    json_to_metadata = {
        "@type": f"{_FILTERS}.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {"rules": [rule],
                          "allow_content_types_regex": {"regex": _JSON_CONTENT_TYPE},
                          "allow_empty_content_type": True},
    }
    return [
        {"name": "envoy.filters.http.json_to_metadata", "typed_config": json_to_metadata},
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
        "http_filters": http_filters(),
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
    return json_format.ParseDict(document, listener_pb2.Listener())
