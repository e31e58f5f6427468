"""Answers when nothing can serve: ``local_reply_config`` mappers turn Envoy's own replies,
picked by response flag (UH no healthy upstream, UO overflow, UT timeout, ...) or, for a
tenant over its rate, by status 429, into
OpenAI-shaped JSON errors (``{"error": {"message", "type", "code"}}``) with the right status
and ``Retry-After``; a pool's ``static_response`` answers instead of its 503 when it has no
healthy host. Measured facts: docs/envoy-routing-notes.md."""

from __future__ import annotations

import json
from typing import Any

from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.envoy.admission import RETRY_AFTER_KEY, tenant_filter
from xds_server.envoy.openai_edges import not_found_mappers
from xds_server.envoy.request_features import MODEL_HEADER, _metadata

# Flags of "no server could take it": none healthy (UH); or, since Envoy's panic threshold
# still sends requests to a pool whose hosts are all unhealthy or draining, none reachable.
_UNREACHABLE = ["UF", "URX", "UR", "UC", "LR"]
# (response flags, status, type, code, message, with Retry-After)
_REPLIES: list[tuple[list[str], int, str, str, str, bool]] = [
    (["UH"], 503, "server_error", "no_healthy_upstream",
     "No server for this model is available right now.", True),
    # over the admission budget (a circuit breaker: envoy/admission.py): refused, not failed
    (["UO"], 429, "requests", "rate_limit_exceeded",
     "The servers for this model are at capacity; retry after Retry-After seconds.", True),
    (_UNREACHABLE, 503, "server_error", "upstream_unavailable",
     "The server for this model could not be reached.", True),
    (["NC"], 503, "server_error", "no_cluster",
     "This model's servers are not configured yet.", True),
    (["UT", "UMSDR"], 504, "timeout", "upstream_timeout",
     "The server for this model did not answer in time.", False),
    (["SI"], 504, "timeout", "stream_idle_timeout",
     "The stream was idle for too long.", False),
]


def _retry_after(config: Config, predicted: bool = False) -> list[dict[str, Any]]:
    """The configured Retry-After; with ``predicted``, then the route's own (an admitting
    pool's predicted wait, ``trimtab.retry_after`` in its metadata), which replaces it when
    the route has one (an empty value adds no header)."""
    seconds = config.listener.local_replies.retry_after_seconds
    headers = [{"header": {"key": "retry-after", "value": str(seconds)},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}] if seconds > 0 else []
    if predicted:
        headers.append({"header": {"key": "retry-after",
                                   "value": f"%METADATA(ROUTE:trimtab:{RETRY_AFTER_KEY})%"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"})
    return headers


def _error_body(message: str, kind: str, code: str) -> dict[str, Any]:
    """A fixed JSON body. Not `json_format`: that is a Struct (a map), and a map inside the
    HCM's Any would serialise in a per-process order, so replicas (and restarts) would disagree
    on the listener's version."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}},
                      sort_keys=True)
    return {"text_format_source": {"inline_string": body}, "content_type": "application/json"}


def _for_pool(pool: PoolConfig) -> dict[str, Any]:
    """A request is the pool's when its x-model header names the model, or it has no such
    header and its body does (the order the routes use)."""
    by_header = {"header_filter": {"header": {"name": MODEL_HEADER,
                                              "string_match": {"exact": pool.model}}}}
    no_header = {"header_filter": {"header": {"name": MODEL_HEADER, "present_match": False}}}
    in_body = {"metadata_filter": {"matcher": _metadata(
        "model", {"string_match": {"exact": pool.model}})}}
    return {"or_filter": {"filters": [by_header,
                                      {"and_filter": {"filters": [no_header, in_body]}}]}}


def _static_mapper(pool: PoolConfig) -> dict[str, Any]:
    static = pool.static_response
    assert static is not None
    flag = {"response_flag_filter": {"flags": ["UH", "NC", *_UNREACHABLE]}}
    return {"filter": {"and_filter": {"filters": [flag, _for_pool(pool)]}},
            "status_code": static.status,
            "body": {"inline_string": static.body},
            "body_format_override": {"text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                                     "content_type": static.content_type}}


def _tenant_mapper(config: Config) -> dict[str, Any]:
    """A tenant over its share of a pressed pool (the local rate limit, envoy/admission.py):
    the budget's 429 with the route's Retry-After. Picked by status, not by the flag RL:
    Envoy's local_ratelimit flags the stream only after its local reply (measured on 1.40),
    and no other local reply here is a 429 (the budget's, flag UO, is matched before)."""
    status = {"status_code_filter": {"comparison": {
        "op": "EQ", "value": {"default_value": 429, "runtime_key": "trimtab.local_reply.429"}}}}
    return {"filter": status, "status_code": 429,
            "headers_to_add": _retry_after(config, predicted=True),
            "body_format_override": _error_body(
                "This model's servers are at capacity and you are over your share of them; "
                "retry after Retry-After seconds.", "requests", "rate_limit_exceeded")}


def local_reply_config(config: Config) -> dict[str, Any]:
    """HCM ``local_reply_config``: per-pool static answers first, then the JSON errors.
    Route ``direct_response``s are local replies too but carry no response flag: our 400s and
    200s stay as they are, our 404s are rewritten to name the model asked for."""
    mappers = [_static_mapper(pool) for pool in config.pools if pool.static_response is not None]
    mappers += not_found_mappers(config)  # our 404s name the model (no flag: not the above)
    for flags, status, kind, code, message, retry in _REPLIES:
        mapper: dict[str, Any] = {"filter": {"response_flag_filter": {"flags": flags}},
                                  "status_code": status,
                                  "body_format_override": _error_body(message, kind, code)}
        headers = _retry_after(config, predicted="UO" in flags) if retry else []
        if headers:
            mapper["headers_to_add"] = headers
        mappers.append(mapper)
    if tenant_filter(config) is not None:
        mappers.append(_tenant_mapper(config))
    too_large = {"status_code_filter": {"comparison": {
        "op": "EQ", "value": {"default_value": 413, "runtime_key": "trimtab.local_reply.413"}}}}
    mappers.append({"filter": too_large, "body_format_override": _error_body(
        "The request body is larger than this gateway accepts.", "invalid_request_error",
        "request_too_large")})
    return {"mappers": mappers}
