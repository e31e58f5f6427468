"""Model routing done natively by Envoy 1.40, proven with a static config.

json_to_metadata copies the body's ``model`` into dynamic metadata and clears
the route cache itself, so routes matching ``dynamic_metadata`` see it.
See docs/envoy-routing-notes.md for the YAML and the gotchas.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import BackendFleet
from trimtab_dev.envoy_process import EnvoyProcess, free_port, validate_config

pytestmark = pytest.mark.slow

NAMESPACE = "trimtab"
MODEL_HEADER = "x-model"
JSON_CONTENT_TYPE_REGEX = r"(?i)^application/json\s*(;.*)?$"
BUFFER_LIMIT = 8 * 1024 * 1024
TYPE = "type.googleapis.com/envoy.extensions.filters"


def _forward(cluster: str) -> dict[str, Any]:
    return {"cluster": cluster, "timeout": "0s", "idle_timeout": "300s"}


def _json_error(
    name: str, match: dict[str, Any], status: int, code: str, msg: str
) -> dict[str, Any]:
    body = json.dumps({"error": {"message": msg, "type": "invalid_request_error", "code": code}})
    return {
        "name": name,
        "match": {"prefix": "/", **match},
        "direct_response": {"status": status, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {
                "header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }


def _metadata_match(value: dict[str, Any]) -> dict[str, Any]:
    return {"dynamic_metadata": [{"filter": NAMESPACE, "path": [{"key": "model"}], "value": value}]}


def model_routes(pools: dict[str, str]) -> list[dict[str, Any]]:
    """Routes for ``{model: cluster}``: header first, then body, then the fallback."""
    routes: list[dict[str, Any]] = []
    for model, cluster in pools.items():
        header = {"name": MODEL_HEADER, "string_match": {"exact": model}}
        routes.append({"name": f"header:{model}", "match": {"prefix": "/", "headers": [header]},
                       "route": _forward(cluster)})  # fmt: skip
    present = {"headers": [{"name": MODEL_HEADER, "present_match": True}]}
    routes.append(_json_error("header:unknown", present, 404, "model_not_found", "unknown model"))
    for model, cluster in pools.items():
        match = _metadata_match({"string_match": {"exact": model}})
        routes.append({"name": f"body:{model}", "match": {"prefix": "/", **match},
                       "route": _forward(cluster)})  # fmt: skip
    unknown = _metadata_match({"present_match": True})
    routes.append(_json_error("body:unknown", unknown, 404, "model_not_found", "unknown model"))
    if len(pools) == 1:
        routes.append({"name": "default", "match": {"prefix": "/"},
                       "route": _forward(next(iter(pools.values())))})  # fmt: skip
    else:
        routes.append(_json_error("no-model", {}, 400, "model_required", "model is required"))
    return routes


def http_filters() -> list[dict[str, Any]]:
    rule = {
        "selectors": [{"key": "model"}],
        "on_present": {"metadata_namespace": NAMESPACE, "key": "model", "type": "STRING"},
    }
    json_to_metadata = {
        "@type": f"{TYPE}.http.json_to_metadata.v3.JsonToMetadata",
        "request_rules": {
            "rules": [rule],
            "allow_content_types_regex": {"regex": JSON_CONTENT_TYPE_REGEX},
            "allow_empty_content_type": True,
        },
    }
    return [
        {"name": "envoy.filters.http.json_to_metadata", "typed_config": json_to_metadata},
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": f"{TYPE}.http.router.v3.Router"}},
    ]  # fmt: skip


def _address(addr: str) -> dict[str, Any]:
    host, port = addr.rsplit(":", 1)
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _cluster(name: str, addr: str) -> dict[str, Any]:
    endpoint = {"endpoint": {"address": _address(addr)}}
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint]}]}}  # fmt: skip


def routing_bootstrap(admin_port: int, listen_port: int, pools: dict[str, str]) -> dict[str, Any]:
    """Static Envoy config: one listener routing by model to ``{model: "ip:port"}``."""
    clusters = {model: f"pool-{model}" for model in pools}
    hcm = {
        "@type": f"{TYPE}.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "route_config": {"name": "models", "virtual_hosts": [
            {"name": "models", "domains": ["*"], "routes": model_routes(clusters)}]},
        "http_filters": http_filters(),
    }  # fmt: skip
    listener = {
        "name": "ingress",
        "address": _address(f"127.0.0.1:{listen_port}"),
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT,
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }  # fmt: skip
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [listener],
            "clusters": [_cluster(clusters[m], addr) for m, addr in pools.items()],
        },
    }


# -- fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[BackendFleet]:
    with BackendFleet(2) as running:
        yield running


def _start_envoy(pools: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    admin_port, listen_port = free_port(), free_port()
    config = routing_bootstrap(admin_port, listen_port, pools)
    with EnvoyProcess() as envoy:
        envoy.start(config, tmp_path_factory.mktemp("envoy") / "envoy.log")
        envoy.wait_ready(timeout=10)
        yield listen_port


@pytest.fixture(scope="module")
def two_pools(fleet: BackendFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    pools = {"A": fleet.addresses[0], "B": fleet.addresses[1]}
    yield from _start_envoy(pools, tmp_path_factory)


@pytest.fixture(scope="module")
def one_pool(fleet: BackendFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    yield from _start_envoy({"A": fleet.addresses[0]}, tmp_path_factory)


def send(
    port: int,
    body: Any = None,
    headers: dict[str, str] | None = None,
    content_type: str | None = "application/json",
) -> tuple[int, str, Any]:
    """One request through Envoy: (status, content-type, parsed JSON or raw text)."""
    hdrs = dict(headers or {})
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    if data is not None and content_type:
        hdrs["content-type"] = content_type
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST" if data is not None else "GET", "/v1/chat/completions", data, hdrs)
        resp = conn.getresponse()
        ctype, raw = resp.getheader("content-type") or "", resp.read().decode()
    finally:
        conn.close()
    return resp.status, ctype, json.loads(raw) if "json" in ctype else raw


# -- tests ---------------------------------------------------------------------


def test_config_validates(fleet: BackendFleet) -> None:
    pools = {"A": fleet.addresses[0], "B": fleet.addresses[1]}
    result = validate_config(routing_bootstrap(free_port(), free_port(), pools))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("model", "index"), [("A", 0), ("B", 1)])
def test_body_model_selects_pool(
    two_pools: int, fleet: BackendFleet, model: str, index: int
) -> None:
    before = fleet.request_count(index)
    status, _, body = send(two_pools, {"model": model, "messages": []})
    assert status == 200
    assert body["backend"] == fleet.addresses[index]
    assert fleet.request_count(index) == before + 1


def test_header_overrides_body(two_pools: int, fleet: BackendFleet) -> None:
    status, _, body = send(two_pools, {"model": "A"}, headers={MODEL_HEADER: "B"})
    assert (status, body["backend"], body["model"]) == (200, fleet.addresses[1], "A")
    status, _, body = send(two_pools, None, headers={MODEL_HEADER: "A"})
    assert (status, body["backend"]) == (200, fleet.addresses[0])


@pytest.mark.parametrize(
    ("body", "headers"),
    [({"model": "nope"}, None), ({"model": "A"}, {MODEL_HEADER: "nope"}), ({"model": 7}, None)],
)
def test_unknown_model_is_json_404(
    two_pools: int, body: Any, headers: dict[str, str] | None
) -> None:
    status, ctype, payload = send(two_pools, body, headers=headers)
    assert status == 404
    assert ctype == "application/json"
    assert payload["error"]["code"] == "model_not_found"


def test_json_content_type_variants_are_parsed(two_pools: int, fleet: BackendFleet) -> None:
    for ctype in ("application/json; charset=utf-8", "Application/JSON", None):
        status, _, body = send(two_pools, {"model": "B"}, content_type=ctype)
        assert (status, body["backend"]) == (200, fleet.addresses[1]), ctype


def test_no_model_with_two_pools_is_json_400(two_pools: int) -> None:
    bodies: list[Any] = [None, {"messages": []}, b"not json", {"model": ""}]
    for body in bodies:
        status, ctype, payload = send(two_pools, body)
        assert (status, ctype) == (400, "application/json"), body
        assert payload["error"]["code"] == "model_required"


def test_single_pool_takes_requests_without_model(one_pool: int, fleet: BackendFleet) -> None:
    bodies: list[Any] = [None, {"messages": []}, {"model": "A"}]
    for body in bodies:
        status, _, payload = send(one_pool, body)
        assert (status, payload["backend"]) == (200, fleet.addresses[0]), body


def test_single_pool_still_404s_unknown_model(one_pool: int) -> None:
    assert send(one_pool, {"model": "B"})[0] == 404
    assert send(one_pool, None, headers={MODEL_HEADER: "B"})[0] == 404


def test_body_over_one_mib_is_routed(two_pools: int, fleet: BackendFleet) -> None:
    status, _, body = send(two_pools, {"model": "B", "prompt": "x" * 2_000_000})
    assert (status, body["backend"]) == (200, fleet.addresses[1])


def test_streaming_response_passes_through(two_pools: int, fleet: BackendFleet) -> None:
    fleet.set_streaming(1, chunks=3, chunk_delay_s=0.05)
    status, ctype, raw = send(two_pools, {"model": "B", "stream": True})
    assert (status, ctype) == (200, "text/event-stream")
    events = [line for line in raw.splitlines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]"
