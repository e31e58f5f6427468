"""Generated Envoy config for request features, and the config keys' validation (exit 2 naming
the key). What Envoy does with it is proven in tests/integration/test_request_features_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from tests.support.paths import EXAMPLES, ROOT
from xds_server.cli import EXIT_BAD_INPUT, main
from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.envoy.clusters import build_clusters
from xds_server.envoy.local_replies import local_reply_config
from xds_server.envoy.request_features import version_cluster
from xds_server.envoy.routes import build_listener, build_route_config, http_filters
from xds_server.envoy.views import pool_closure, pool_clusters


def _pools(vl_model: str = "mv", **chat: Any) -> list[dict[str, Any]]:
    return [{"name": "chat", "model": "m", "endpoints": [{"address": "10.0.0.1:80"}], **chat},
            {"name": "vl", "model": vl_model, "endpoints": [{"address": "10.0.0.2:80"}]},
            {"name": "other", "model": "o", "endpoints": [{"address": "10.0.0.3:80"}]}]


def _config(vl_model: str = "mv", **chat: Any) -> Config:
    return parse_config({"pools": _pools(vl_model, **chat)})


def _rules(config: Config) -> list[tuple[str, str, str]]:
    j2m = http_filters(config)[0]["typed_config"]["request_rules"]["rules"]
    return [(r["selectors"][0]["key"], r["on_present"]["key"], r["on_present"]["type"])
            for r in j2m]


def _route_names(config: Config) -> list[str]:
    return [route.name for route in build_route_config(config).virtual_hosts[0].routes]


def test_without_request_features_the_filters_are_as_before() -> None:
    config = _config()
    assert _rules(config) == [("model", "model", "STRING")]
    assert [f["name"] for f in http_filters(config)] == ["envoy.filters.http.json_to_metadata",
                                                        "envoy.filters.http.router"]
    assert http_filters(config) == http_filters()


def test_only_the_fields_a_class_uses_are_extracted() -> None:
    config = _config(request_classes=[{"pool": "vl", "max_tokens": {"min": 4097}},
                                      {"pool": "vl", "stream": False}])
    assert _rules(config) == [("model", "model", "STRING"),
                              ("max_tokens", "max_tokens", "NUMBER"),
                              ("max_completion_tokens", "max_tokens", "NUMBER"),  # wins: last
                              ("stream", "stream", "PROTOBUF_VALUE")]
    assert "envoy.filters.http.lua" not in [f["name"] for f in http_filters(config)]


def test_a_modality_class_adds_the_bounded_lua_filter_before_the_router() -> None:
    config = parse_config({"listener": {"modality_inspect_bytes": 4096},
                           "pools": _pools(request_classes=[{"pool": "vl",
                                                             "modality": "image"}])})
    names = [f["name"] for f in http_filters(config)]
    assert names == ["envoy.filters.http.json_to_metadata", "envoy.filters.http.lua",
                     "envoy.filters.http.router"]
    source = http_filters(config)[1]["typed_config"]["default_source_code"]["inline_string"]
    assert "local LIMIT = 4096" in source and "clearRouteCache" in source
    build_listener(config)  # the Lua type is registered and the listener parses


def test_class_routes_come_before_the_pools_own_route_and_targets_get_none() -> None:
    config = _config("m", request_classes=[{"pool": "vl", "modality": "image"}],
                     long_context={"pool": "other", "min_prompt_bytes": 100})
    names = _route_names(config)
    assert names.index("body:chat:class0") < names.index("body:chat:size0") < \
        names.index("body:chat")
    assert not [n for n in names if n.startswith(("body:vl", "header:vl"))]  # same model
    route = next(r for r in build_route_config(config).virtual_hosts[0].routes
                 if r.name == "body:chat:class0")
    assert route.route.cluster == "vl"
    keys = [m.path[0].key for m in route.match.dynamic_metadata]
    assert keys == ["model", "modality"]


def test_ranges_are_min_inclusive_max_exclusive_and_open_ends_far() -> None:
    config = _config(request_classes=[{"pool": "vl", "temperature": {"max": 0.3},
                                       "n": {"min": 2, "max": 8}}])
    route = next(r for r in build_route_config(config).virtual_hosts[0].routes
                 if r.name == "body:chat:class0")
    ranges = {m.path[0].key: (m.value.double_match.range.start, m.value.double_match.range.end)
              for m in route.match.dynamic_metadata if m.path[0].key != "model"}
    assert ranges["n"] == (2.0, 8.0)
    assert ranges["temperature"][1] == 0.3 and ranges["temperature"][0] < -1e100


def test_local_replies_are_json_with_retry_after_on_503_and_429_only() -> None:
    config = parse_config({"listener": {"local_replies": {"retry_after_seconds": 9}},
                           "pools": _pools()})
    mappers = local_reply_config(config)["mappers"]
    by_flag = {flag: m for m in mappers
               for flag in m["filter"].get("response_flag_filter", {}).get("flags", [])}
    assert by_flag["UH"]["status_code"] == 503
    assert by_flag["UH"]["headers_to_add"][0]["header"] == {"key": "retry-after", "value": "9"}
    overloaded = by_flag["UO"]["body_format_override"]["text_format_source"]["inline_string"]
    assert by_flag["UO"]["status_code"] == 429  # over the admission budget: refused, not failed
    assert json.loads(overloaded)["error"]["code"] == "rate_limit_exceeded"
    assert [h["header"]["value"] for h in by_flag["UO"]["headers_to_add"]] == [
        "9", "%METADATA(ROUTE:trimtab:retry_after)%"]  # the route's prediction wins
    assert by_flag["UT"]["status_code"] == 504 and "headers_to_add" not in by_flag["UT"]
    document = json_format.MessageToDict(build_listener(config))
    hcm = document["filterChains"][0]["filters"][0]["typedConfig"]
    assert len(hcm["localReplyConfig"]["mappers"]) == len(mappers)
    off = parse_config({"listener": {"local_replies": {"retry_after_seconds": 0}},
                        "pools": _pools()})
    assert [m["filter"]["response_flag_filter"]["flags"] for m in local_reply_config(off)["mappers"]
            if "headers_to_add" in m] == [["UO"]]  # only an admitting route's own value


def test_a_static_answer_comes_first_and_names_its_model() -> None:
    config = _config(static_response={"body": '{"choices": []}'})
    first = local_reply_config(config)["mappers"][0]
    assert first["status_code"] == 200 and first["body"]["inline_string"] == '{"choices": []}'
    assert "'exact': 'm'" in str(first["filter"])


def test_model_versions_add_an_aggregate_and_version_routes() -> None:
    config = parse_config({"pools": [
        {"name": "v1", "model": "m", "endpoints": [{"address": "10.0.0.1:80"}],
         "fallback": "small", "model_versions": {"pools": {"2": "v2"}}},
        {"name": "v2", "model": "m", "endpoints": [{"address": "10.0.0.2:80"}],
         "affinity": {"header": "x-session-id"}},
        {"name": "small", "model": "s", "endpoints": [{"address": "10.0.0.3:80"}]}]})
    v1 = config.pool("v1")
    aggregate = next(c for c in build_clusters(v1) if c.name == version_cluster(v1, "v2"))
    assert aggregate.cluster_type.name == "envoy.clusters.aggregate"
    assert b"v2" in aggregate.cluster_type.typed_config.value
    routes = {r.name: r for r in build_route_config(config).virtual_hosts[0].routes}
    header = routes["body:v1:version:2"]
    assert header.route.cluster == "trimtab-version-v1-v2"
    assert header.route.hash_policy[0].header.header_name == "x-session-id"
    assert header.route.retry_policy.retry_priority.name.endswith("previous_priorities")
    assert "body:v1:version-body:2" in routes
    assert version_cluster(v1, "v2") in pool_clusters(v1)
    assert pool_closure(config, ["v1"]) == {"v1", "v2", "small"}


BAD = [
    ({"request_classes": [{"pool": "nowhere", "stream": True}]},
     "pools[chat].request_classes[0].pool: expected another pool's name"),
    ({"request_classes": [{"pool": "chat", "stream": True}]},
     "pools[chat].request_classes[0].pool: expected another pool's name"),
    ({"request_classes": [{"pool": "vl"}]}, "pools[chat].request_classes[0]: needs at least one"),
    ({"request_classes": [{"pool": "vl", "modality": "video"}]},
     "pools[chat].request_classes[0].modality"),
    ({"request_classes": [{"pool": "vl", "max_tokens": {"min": 10, "max": 10}}]},
     "pools[chat].request_classes[0].max_tokens: max (10.0) must be above min"),
    ({"request_classes": [{"pool": "vl", "n": {}}]}, "pools[chat].request_classes[0].n: give min"),
    ({"request_classes": [{"pool": "vl", "stream": False, "top_p": {"min": 1}}]},
     "pools[chat].request_classes[0].top_p: unknown key"),
    ({"static_response": {"status": 100, "body": "x"}}, "pools[chat].static_response.status"),
    ({"static_response": {"body": ""}}, "pools[chat].static_response.body"),
    ({"model_versions": {"pools": {"2": "nowhere"}}},
     "pools[chat].model_versions.pools.2: expected another pool's name"),
    ({"model_versions": {"pools": {"a b": "vl"}}}, "pools[chat].model_versions.pools"),
    ({"model_versions": {"pools": {}}}, "pools[chat].model_versions.pools"),
]


@pytest.mark.parametrize(("chat", "named"), BAD, ids=[named.split(":")[0] for _, named in BAD])
def test_bad_request_feature_keys_exit_2_naming_them(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     chat: dict[str, Any], named: str) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump({"pools": _pools(**chat)}))
    assert main(["validate", "--config", str(path)]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("listener", "named"), [
    ({"local_replies": {"retry_after_seconds": -1}}, "listener.local_replies.retry_after_seconds"),
    ({"modality_inspect_bytes": 10}, "listener.modality_inspect_bytes"),
    ({"modality_inspect_bytes": 9 * 1024 * 1024}, "listener.modality_inspect_bytes"),
])
def test_bad_listener_keys_exit_2_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              listener: dict[str, Any], named: str) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump({"listener": listener, "pools": _pools()}))
    assert main(["validate", "--config", str(path)]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


def test_the_tiers_example_validates_and_builds() -> None:
    from xds_server.config.load import load_config

    config = load_config(EXAMPLES / "trimtab-tiers.yaml")
    names = _route_names(config)
    assert {"body:chat:class0", "body:chat:tier:code", "body:chat:version:3.2"} <= set(names)
    assert [f["name"] for f in http_filters(config)] == [
        "envoy.filters.http.json_to_metadata", "envoy.filters.http.lua",
        "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    build_listener(config)


def test_the_lua_filter_is_off_on_routes_of_pools_without_a_modality_class() -> None:
    from envoy.extensions.filters.http.lua.v3 import lua_pb2

    config = _config(request_classes=[{"pool": "vl", "modality": "image"}])
    routes = {r.name: r for r in build_route_config(config).virtual_hosts[0].routes}

    def runs(name: str) -> bool:
        per_route = routes[name].typed_per_filter_config
        if "envoy.filters.http.lua" not in per_route:
            return True
        off = lua_pb2.LuaPerRoute()
        assert per_route["envoy.filters.http.lua"].Unpack(off)
        return not off.disabled

    assert runs("body:chat") and runs("header:chat") and runs("body:chat:class0")
    assert not runs("body:other") and not runs("no-model") and not runs("body:unknown")
    assert not any(r.typed_per_filter_config for r in build_route_config(_config())
                   .virtual_hosts[0].routes)



_LISTENER_HASH = """
import hashlib
from xds_server.config.load import load_config
from xds_server.envoy.routes import build_listener, build_route_config
config = load_config("examples/trimtab-tiers.yaml")
for message in (build_listener(config), build_route_config(config)):
    print(hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest())
"""


def test_the_listener_and_routes_are_the_same_bytes_in_every_process() -> None:
    """Versions are content hashes: replicas and restarts must agree byte for byte (a map
    inside an Any, e.g. a Struct, serialises in a per-process order)."""
    root = ROOT
    hashes = {subprocess.run([sys.executable, "-c", _LISTENER_HASH], cwd=root, check=True,
                             capture_output=True, text=True,
                             env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}
                             ).stdout for seed in (1, 2, 3)}
    assert len(hashes) == 1, hashes
