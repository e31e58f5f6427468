"""The OpenAI-compatible edges Envoy answers itself (no backend hop, no ext_proc).

* ``GET /v1/models`` answers OpenAI's list of the models the pools serve, and
  ``GET /v1/models/{id}`` the model object: ``direct_response`` routes built from the config,
  with fixed bytes. Any other ``GET /v1/models/...`` is a 404 ``model_not_found``.
* A body that claims to be JSON (``application/json``, curl's default
  ``application/x-www-form-urlencoded``, or no content type) and does not parse is a 400
  ``invalid_json``: the model rule's ``on_error`` writes ``trimtab.body_error``, and a route
  placed first answers it. json_to_metadata also runs ``on_error`` on a content type it does not
  accept (measured on 1.40), so that route is limited to the accepted content types: a
  ``multipart/form-data`` upload with an ``x-model`` header (or to a single pool) still passes.
* A model that is not served is a 404 that names it and lists what is served. A direct
  response's body is fixed per route, so ``local_reply_config`` mappers (they apply to direct
  responses too) rewrite our 404s with ``json_format``, whose values Envoy escapes as JSON
  strings: a model name with quotes or backslashes keeps the body valid JSON.

Measured facts: docs/envoy-routing-notes.md ("OpenAI edges").
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from xds_server.config.schema import Config
from xds_server.envoy.request_features import MODEL_HEADER, NAMESPACE

MODELS_PATH = "/v1/models"
BODY_ERROR_KEY = "body_error"  # written by the model rule's on_error
OWNER = "trimtab"
# Bodies json_to_metadata parses: JSON, and curl -d's default (its body is JSON all the same).
JSON_CONTENT_TYPES = r"(?i)^application/(json|x-www-form-urlencoded)\s*(;.*)?$"
# The same, or no content type at all (a missing header reads as empty).
_CLAIMS_JSON = r"(?i)^(application/(json|x-www-form-urlencoded)\s*(;.*)?)?$"
_JSON = {"header": {"key": "content-type", "value": "application/json"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
_PATH_SAFE = "/:@!$&'()*+,;="  # RFC 3986 pchar (and /) a client may leave unencoded
_GET = {"name": ":method", "string_match": {"exact": "GET"}}


def served_models(config: Config) -> list[str]:
    """Every model name a pool serves, once each, in config order."""
    return list(dict.fromkeys(pool.model for pool in config.pools))


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": OWNER}


def models_list_body(config: Config) -> str:
    return json.dumps({"object": "list",
                       "data": [_model_object(model) for model in served_models(config)]})


def _direct(name: str, match: dict[str, Any], status: int, body: str) -> dict[str, Any]:
    return {"name": name, "match": match,
            "direct_response": {"status": status, "body": {"inline_string": body}},
            "response_headers_to_add": [dict(_JSON)]}


def _paths(model: str) -> list[str]:
    """The paths a client may send for ``GET /v1/models/{model}``: the id percent-encoded
    (``/`` as ``%2F``), or with the characters a path segment allows (``/`` included) raw."""
    return sorted({f"{MODELS_PATH}/{quote(model, safe='')}",
                   f"{MODELS_PATH}/{quote(model, safe=_PATH_SAFE)}"})


def models_routes(config: Config) -> list[dict[str, Any]]:
    """``GET /v1/models``, ``GET /v1/models/{id}`` per served model, then the lookup's 404
    (its body is rewritten by :func:`not_found_mappers`)."""
    routes = [_direct("models:list", {"path": MODELS_PATH, "headers": [_GET]}, 200,
                      models_list_body(config))]
    for model in served_models(config):
        body = json.dumps(_model_object(model))
        for index, path in enumerate(_paths(model)):
            routes.append(_direct(f"models:get:{model}:{index}", {"path": path, "headers": [_GET]},
                                  200, body))
    routes.append(_direct("models:unknown", {"prefix": f"{MODELS_PATH}/", "headers": [_GET]},
                          404, _error("The model is not served here.", "model_not_found",
                                      "model")))
    return routes


def _error(message: str, code: str, param: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": param, "code": code}})


def invalid_body_route() -> dict[str, Any]:
    """A body that claims to be JSON and is not: 400, before every other route (the model
    rule's ``on_error`` wrote ``trimtab.body_error`` and cleared the route cache)."""
    claims_json = {"name": "content-type", "string_match": {"safe_regex": {"regex": _CLAIMS_JSON}},
                   "treat_missing_header_as_empty": True}
    written = [{"filter": NAMESPACE, "path": [{"key": BODY_ERROR_KEY}],
                "value": {"present_match": True}}]
    return _direct("invalid-json", {"prefix": "/", "headers": [claims_json],
                                    "dynamic_metadata": written}, 400,
                   _error("We could not parse the JSON body of your request: it is not valid "
                          "JSON. Send a JSON object with content-type: application/json.",
                          "invalid_json"))


def on_error() -> dict[str, Any]:
    """The model rule's ``on_error``: mark the body as not JSON (a value is required)."""
    return {"metadata_namespace": NAMESPACE, "key": BODY_ERROR_KEY, "value": "invalid_json"}


def content_type_json() -> list[dict[str, Any]]:
    """``request_headers_to_add`` of a route that matched the body's model: the body parsed as
    JSON, so the upstream is told so (curl -d's form content type would get a 415/422)."""
    return [dict(_JSON)]


def _literal(text: str) -> str:
    """Envoy's formatter reads %...% in a format string; a literal % is written %%."""
    return text.replace("%", "%%")


def _not_found_body(named: str, config: Config) -> dict[str, Any]:
    """``named``: what names the model, e.g. "The model `%REQ(x-model)%`"."""
    served = ", ".join(served_models(config)) or "none"
    message = f"{named} does not exist or is not served here. Served models: {_literal(served)}."
    return {"json_format": {"error": {"message": message, "type": "invalid_request_error",
                                      "param": "model", "code": "model_not_found"}},
            "content_type": "application/json"}


def not_found_mappers(config: Config) -> list[dict[str, Any]]:
    """``local_reply_config`` mappers for our own 404s (no upstream reply is a local reply, and
    no route here gives Envoy's 'no route' 404), naming what was asked for: the lookup's path,
    else the ``x-model`` header (it wins over the body, as the routes do), else the body's
    model. ``json_format`` escapes the substituted value."""
    status = {"status_code_filter": {"comparison": {
        "op": "EQ", "value": {"default_value": 404, "runtime_key": "trimtab.local_reply.404"}}}}
    lookup = [{"header_filter": {"header": _GET}},
              {"header_filter": {"header": {"name": ":path", "string_match": {
                  "prefix": f"{MODELS_PATH}/"}}}}]
    header = {"header_filter": {"header": {"name": MODEL_HEADER, "present_match": True}}}
    body = {"metadata_filter": {"matcher": {"filter": NAMESPACE, "path": [{"key": "model"}],
                                            "value": {"present_match": True}}}}
    return [
        {"filter": {"and_filter": {"filters": [status, *lookup]}}, "status_code": 404,
         "body_format_override": _not_found_body("The model at `%REQ(:path)%`", config)},
        {"filter": {"and_filter": {"filters": [status, header]}}, "status_code": 404,
         "body_format_override": _not_found_body(f"The model `%REQ({MODEL_HEADER})%`", config)},
        {"filter": {"and_filter": {"filters": [status, body]}}, "status_code": 404,
         "body_format_override": _not_found_body(
             f"The model `%DYNAMIC_METADATA({NAMESPACE}:model)%`", config)},
    ]
