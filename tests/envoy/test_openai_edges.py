"""The OpenAI edges in the built routes and listener (Envoy's behaviour with them:
tests/integration/test_openai_edges_static.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.envoy import openai_edges
from xds_server.envoy.local_replies import local_reply_config
from xds_server.envoy.routes import build_route_config, http_filters

ROOT = Path(__file__).resolve().parents[2]


def _config(*models: str, **extra: Any) -> Config:
    pools = [{"name": f"p{i}", "model": model, "endpoints": [{"address": f"10.0.0.{i + 1}:80"}]}
             for i, model in enumerate(models)]
    return parse_config({"pools": pools, **extra})


def _routes(config: Config) -> list[dict[str, Any]]:
    document = json_format.MessageToDict(build_route_config(config),
                                         preserving_proto_field_name=True)
    return document["virtual_hosts"][0]["routes"]


def _by_name(config: Config) -> dict[str, dict[str, Any]]:
    return {route["name"]: route for route in _routes(config)}


def test_the_edges_come_before_every_model_route_with_one_pool_or_several() -> None:
    for models in (("m",), ("m", "n")):
        names = [route["name"] for route in _routes(_config(*models))]
        assert names[:2] == ["invalid-json", "models:list"], names
        first_model_route = names.index("header:p0")
        assert names[first_model_route - 1] == "models:unknown"
        assert {n for n in names[:first_model_route] if n.startswith("models:get:")} == {
            f"models:get:{m}:0" for m in models}


def test_the_models_list_is_the_openai_list_of_served_models_in_config_order() -> None:
    config = parse_config({"pools": [
        {"name": "big", "model": "org/b", "long_context": {"pool": "long", "min_prompt_bytes": 9},
         "endpoints": [{"address": "10.0.0.1:80"}]},
        {"name": "long", "model": "org/b", "endpoints": [{"address": "10.0.0.2:80"}]},
        {"name": "a", "model": "a", "endpoints": [{"address": "10.0.0.3:80"}]}]})
    route = _by_name(config)["models:list"]
    assert route["match"] == {"path": "/v1/models", "headers": [
        {"name": ":method", "string_match": {"exact": "GET"}}]}
    body = route["direct_response"]["body"]["inline_string"]
    assert json.loads(body) == {"object": "list", "data": [
        {"id": "org/b", "object": "model", "created": 0, "owned_by": "trimtab"},
        {"id": "a", "object": "model", "created": 0, "owned_by": "trimtab"}]}
    assert body == openai_edges.models_list_body(config)  # fixed bytes: same config, same body
    assert route["direct_response"]["status"] == 200
    assert route["response_headers_to_add"][0]["header"] == {"key": "content-type",
                                                             "value": "application/json"}


def test_a_model_is_looked_up_by_its_id_raw_or_percent_encoded() -> None:
    routes = _by_name(_config("org/m:1", "plain"))
    paths = {r["match"]["path"]: json.loads(r["direct_response"]["body"]["inline_string"])["id"]
             for name, r in routes.items() if name.startswith("models:get:")}
    assert paths == {"/v1/models/org/m:1": "org/m:1", "/v1/models/org%2Fm%3A1": "org/m:1",
                     "/v1/models/plain": "plain"}
    unknown = routes["models:unknown"]
    assert unknown["match"]["prefix"] == "/v1/models/"
    assert unknown["direct_response"]["status"] == 404


def test_the_model_rule_marks_a_body_that_is_not_json_and_form_bodies_are_read() -> None:
    rules = http_filters(_config("m", "n"))[0]["typed_config"]["request_rules"]
    model_rule = rules["rules"][0]
    assert model_rule["on_error"] == {"metadata_namespace": "trimtab", "key": "body_error",
                                      "value": "invalid_json"}
    accepted = re.compile(rules["allow_content_types_regex"]["regex"])
    for ctype in ("application/json", "Application/JSON; charset=utf-8",
                  "application/x-www-form-urlencoded"):
        assert accepted.match(ctype), ctype
    for ctype in ("multipart/form-data; boundary=x", "text/plain", "application/jsonl"):
        assert not accepted.match(ctype), ctype
    assert rules["allow_empty_content_type"] is True


def test_the_400_route_judges_only_bodies_claimed_as_json() -> None:
    route = _by_name(_config("m"))["invalid-json"]
    assert route["match"]["dynamic_metadata"] == [{"filter": "trimtab", "path": [
        {"key": "body_error"}], "value": {"present_match": True}}]
    header = route["match"]["headers"][0]
    assert header["name"] == "content-type" and header["treat_missing_header_as_empty"]
    claims = re.compile(header["string_match"]["safe_regex"]["regex"])
    assert claims.match("") and claims.match("application/x-www-form-urlencoded")
    assert not claims.match("multipart/form-data; boundary=x")  # on_error runs for it too
    error = json.loads(route["direct_response"]["body"]["inline_string"])["error"]
    assert route["direct_response"]["status"] == 400
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")


def test_routes_chosen_by_the_body_tell_the_upstream_it_is_json_header_routes_do_not() -> None:
    routes = _routes(_config("m", "n"))
    body = [r for r in routes if r["name"].startswith("body:p") and "route" in r]
    header = [r for r in routes if r["name"].startswith("header:p")]
    assert body and header
    for route in body:
        assert route["request_headers_to_add"] == [{
            "header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}], route["name"]
    assert not [r["name"] for r in header if "request_headers_to_add" in r]
    single = {r["name"]: r for r in _routes(_config("m"))}
    assert "request_headers_to_add" not in single["default"]  # no model: the body as it came


def test_our_404s_are_rewritten_to_name_the_model_and_list_the_served() -> None:
    config = _config("m", "100%")
    mappers = local_reply_config(config)["mappers"]
    not_found = [m for m in mappers if m.get("status_code") == 404]
    assert len(not_found) == 3
    named = [m["body_format_override"]["json_format"]["error"]["message"] for m in not_found]
    assert [message.split("`")[1] for message in named] == [
        "%REQ(:path)%", "%REQ(x-model)%", "%DYNAMIC_METADATA(trimtab:model)%"]
    assert all(message.endswith("Served models: m, 100%%.") for message in named)  # literal %
    for mapper in not_found:
        filters = mapper["filter"]["and_filter"]["filters"]
        assert filters[0]["status_code_filter"]["comparison"]["value"]["default_value"] == 404
        assert mapper["body_format_override"]["content_type"] == "application/json"
    header_mapper = not_found[1]["filter"]["and_filter"]["filters"][1]["header_filter"]
    assert header_mapper["header"] == {"name": "x-model", "present_match": True}


def test_a_static_answer_still_comes_before_the_404_mappers() -> None:
    config = parse_config({"pools": [{"name": "p", "model": "m", "endpoints": [
        {"address": "10.0.0.1:80"}], "static_response": {"body": "{}"}}]})
    mappers = local_reply_config(config)["mappers"]
    assert mappers[0]["body"]["inline_string"] == "{}"
    assert [m.get("status_code") for m in mappers[1:4]] == [404, 404, 404]


_BYTES = """
import hashlib, sys
from xds_server.config.load import parse_config
from xds_server.envoy.routes import build_listener
config = parse_config({"pools": [{"name": "p", "model": "m",
                                  "endpoints": [{"address": "10.0.0.1:80"}]}]})
print(hashlib.sha256(build_listener(config).SerializeToString(deterministic=True)).hexdigest())
"""


def test_the_listener_is_the_same_bytes_in_every_process() -> None:
    """json_format is a Struct (a map): packed without sorting, its order follows the process's
    hash seed, and replicas would publish different listener versions."""
    digests = {subprocess.run([sys.executable, "-c", _BYTES], cwd=ROOT, check=True, text=True,
                              capture_output=True, env={"PYTHONHASHSEED": str(seed),
                                                        "PATH": "/usr/bin:/bin"}).stdout
               for seed in (1, 2, 3)}
    assert len(digests) == 1, digests
