"""Admission in Envoy's resources (xds_server/envoy/admission.py): the RTDS layer of
circuit-breaker limits and tenant enforcement, the routes' priorities, Retry-After and
tenant buckets, and the 429s."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format

from weight_calculator.admission import PoolBudget
from weight_calculator.fairness import TenantCap
from weight_calculator.health import HEALTHY
from weight_calculator.types import EndpointWeight, PoolWeights
from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.control.admission import AdmissionState, next_state
from xds_server.envoy.admission import (
    ANONYMOUS,
    TENANT_FILTER,
    ClusterLimits,
    RouteAdmission,
    retry_after_seconds,
    runtime_layer,
    tenant_bucket,
)
from xds_server.envoy.local_replies import local_reply_config
from xds_server.envoy.routes import build_listener, build_route_config


def _config(**admission: object) -> Config:
    pool: dict[str, object] = {"name": "chat", "model": "m", "endpoints": [{"address": "127.0.0.1:8000"}],
            "slo": {"ttft_seconds": 3}}
    if admission:
        pool["admission"] = admission
    return parse_config({"pools": [pool, {"name": "other", "model": "o",
                                          "endpoints": [{"address": "127.0.0.1:8001"}]}]})


def test_the_layer_holds_each_clusters_limit_per_priority() -> None:
    layer = json_format.MessageToDict(runtime_layer({"chat": ClusterLimits(20, 10)}))
    assert layer == {"name": "trimtab-admission", "layer": {
        "circuit_breakers.chat.high.max_requests": 20.0,
        "circuit_breakers.chat.default.max_requests": 10.0}}
    assert runtime_layer({}).layer.fields == {}


def test_routes_of_an_admitting_pool_carry_priority_and_retry_after() -> None:
    routes = build_route_config(_config(), admission=RouteAdmission(retry_after={"chat": 4})).virtual_hosts[0].routes
    chat = [r for r in routes if r.name.startswith("body:chat")]
    assert [r.name for r in chat] == ["body:chat:batch", "body:chat"]
    batch, plain = chat
    assert batch.route.priority == 0 and plain.route.priority == 1  # DEFAULT, HIGH
    assert batch.match.headers[-1].name == "x-priority"
    assert batch.match.headers[-1].string_match.exact == "batch"
    assert plain.metadata.filter_metadata["trimtab"]["retry_after"] == "4"
    other = [r for r in routes if r.name.startswith("body:other")]
    assert [r.name for r in other] == ["body:other"] and not other[0].HasField("metadata")


def test_batch_by_default_moves_interactive_to_the_header() -> None:
    config = _config(default_priority="batch")
    routes = build_route_config(config).virtual_hosts[0].routes
    chat = {r.name: r for r in routes if r.name.startswith("header:chat")}
    assert chat["header:chat:interactive"].route.priority == 1
    assert chat["header:chat"].route.priority == 0


def test_each_envoy_gets_its_part_and_batch_its_share() -> None:
    config = _config(batch_share=0.25)
    state = AdmissionState({"chat": PoolBudget(40, 16, 3.0)}, {"chat": 2})
    assert state.limits(config) == {"chat": ClusterLimits(interactive=20, batch=5)}
    assert state.retry_after(config) == {"chat": 4}
    unmeasured = AdmissionState({"chat": PoolBudget(None, 16, 0.0)}, {"chat": 1})
    assert unmeasured.limits(config) == {} and unmeasured.retry_after(config) == {}


def test_retry_after_moves_by_powers_of_two() -> None:
    assert [retry_after_seconds(s) for s in (0.2, 1.0, 1.5, 3.0, 9.0, 33.0, 500.0)] == [
        1, 1, 2, 4, 16, 60, 60]


def _tenant_config(**admission: object) -> Config:
    return _config(tenant_header="X-Tenant", max_tenants=500, **admission)


def test_tenant_routes_carry_a_bucket_per_tenant_at_the_cap() -> None:
    from envoy.extensions.filters.http.local_ratelimit.v3 import local_rate_limit_pb2

    routes = build_route_config(_tenant_config(), admission=RouteAdmission(tenants={"chat": 8})).virtual_hosts[0].routes
    chat = [r for r in routes if r.name.startswith(("body:chat", "header:chat"))]
    assert len(chat) == 4
    for route in chat:
        limit = local_rate_limit_pb2.LocalRateLimit()
        assert route.typed_per_filter_config[TENANT_FILTER].Unpack(limit)
        (descriptor,) = limit.descriptors
        assert [(e.key, e.value) for e in descriptor.entries] == [("tenant", "")]  # dynamic
        bucket = descriptor.token_bucket  # 2 ** (8/4) = 4 requests/s: 1 token every 250 ms
        assert (bucket.tokens_per_fill.value, bucket.fill_interval.ToMilliseconds(),
                bucket.max_tokens) == (1, 250, 4)
        assert limit.max_dynamic_descriptors.value == 500
        assert limit.filter_enforced.runtime_key == "trimtab.tenants.chat.enforced"
        assert limit.filter_enforced.default_value.numerator == 0  # counts, refuses only on
        assert limit.filter_enabled.default_value.numerator == 100
        named, anonymous = limit.rate_limits
        assert named.actions[0].request_headers.header_name == "x-tenant"
        assert anonymous.actions[0].header_value_match.descriptor_value == ANONYMOUS
        assert anonymous.actions[0].header_value_match.HasField("expect_match")
        assert not anonymous.actions[0].header_value_match.expect_match.value
    other = [r for r in routes if r.name.startswith("body:other")]
    assert TENANT_FILTER not in other[0].typed_per_filter_config


def test_no_cap_yet_or_no_header_means_no_tenant_limit() -> None:
    unmeasured = build_route_config(_tenant_config()).virtual_hosts[0].routes
    assert not any(TENANT_FILTER in r.typed_per_filter_config for r in unmeasured)
    plain = build_route_config(_config(), admission=RouteAdmission(tenants={"chat": 8})).virtual_hosts[0].routes
    assert not any(TENANT_FILTER in r.typed_per_filter_config for r in plain)


def test_the_listener_has_the_filter_before_the_router_only_with_a_tenant_header() -> None:
    def filters(config: Config) -> list[str]:
        hcm = json_format.MessageToDict(build_listener(config))["filterChains"][0]["filters"][0]
        return [f["name"] for f in hcm["typedConfig"]["httpFilters"]]

    assert filters(_tenant_config())[-2:] == [TENANT_FILTER, "envoy.filters.http.router"]
    assert TENANT_FILTER not in filters(_config())


def test_a_tenant_over_its_share_gets_the_openai_429_with_the_routes_retry_after() -> None:
    mappers = local_reply_config(_tenant_config())["mappers"]
    rl = mappers[-2]  # after the budget's (flag UO), before the 413's: picked by status 429
    assert rl["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 429
    assert rl["status_code"] == 429
    body = json.loads(rl["body_format_override"]["text_format_source"]["inline_string"])
    assert set(body) == {"error"} and body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["type"] == "requests" and body["error"]["message"]
    assert rl["headers_to_add"][-1]["header"] == {
        "key": "retry-after", "value": "%METADATA(ROUTE:trimtab:retry_after)%"}
    plain = local_reply_config(_config())["mappers"]
    assert len(plain) == len(mappers) - 1 and plain[-2]["status_code"] != 429


def test_the_layer_turns_enforcement_on_for_pressed_pools_only() -> None:
    layer = json_format.MessageToDict(runtime_layer({"chat": ClusterLimits(20, 10)}, ["chat"]))
    assert layer["layer"]["trimtab.tenants.chat.enforced"] == 100.0
    assert "trimtab.tenants.chat.enforced" not in json_format.MessageToDict(
        runtime_layer({"chat": ClusterLimits(20, 10)}))["layer"]
    state = AdmissionState({}, {}, {"chat": TenantCap(8, True), "other": TenantCap(3, False)})
    assert state.enforced() == ["chat"] and state.tenant_levels() == {"chat": 8, "other": 3}


def test_buckets_fill_at_the_cap() -> None:
    for rate in (0.05, 0.7, 1.0, 3.3, 17.0, 450.0):
        bucket = tenant_bucket(rate)
        seconds = float(bucket["fill_interval"].rstrip("s"))
        assert bucket["tokens_per_fill"] / seconds == pytest.approx(rate, rel=0.03), rate
        assert seconds >= 0.05 and bucket["max_tokens"] >= bucket["tokens_per_fill"]


def test_each_tick_steers_the_cap_of_a_pool_with_a_tenant_header() -> None:
    # one engine running 8, 30 waiting, 2 completions/s: budget 8 + 4, far over half the queue
    full = EndpointWeight(50, False, False, {"running": 8.0, "queue": 30.0}, 0.0, "ok", HEALTHY,
                          {"service_rate_used": 2000.0, "work_per_request": 1000.0})
    weights = {"chat": PoolWeights({"127.0.0.1:8000": full}, fail_static=False)}
    first = next_state(_tenant_config(), weights, AdmissionState(), lambda pool: 1)
    assert first.tenants == {"chat": TenantCap(2, True, 38.0)}  # 2/s, less two levels
    second = next_state(_tenant_config(), weights, first, lambda pool: 1)
    assert second.tenants["chat"].level == 0 and second.enforced() == ["chat"]
    assert next_state(_config(), weights, AdmissionState(), lambda pool: 1).tenants == {}


def _fallback_config(**chat: object) -> object:
    return parse_config({"pools": [
        {"name": "chat", "model": "m", "endpoints": [{"address": "127.0.0.1:8000"}],
         "slo": {"ttft_seconds": 3}, "fallback": "spare", **chat},
        {"name": "spare", "model": "s", "endpoints": [{"address": "127.0.0.1:8001"}]}]})


def _plain_route(config: object, spill: int) -> object:
    routes = build_route_config(config, admission=RouteAdmission(spill={"chat": spill}))
    return next(r for r in routes.virtual_hosts[0].routes if r.name == "body:chat")


def test_a_spill_splits_the_pools_traffic_with_its_fallback() -> None:
    config = _fallback_config()
    assert _plain_route(config, 0).route.cluster == "chat-with-fallback"
    split = _plain_route(config, 300).route.weighted_clusters.clusters
    assert [(c.name, c.weight.value) for c in split] == [("chat-with-fallback", 700), ("spare", 300)]
    assert _plain_route(config, 1000).route.cluster == "spare"


def test_a_spill_shares_what_the_canary_leaves() -> None:
    config = parse_config({"pools": [
        {"name": "chat", "model": "m", "slo": {"ttft_seconds": 3}, "fallback": "spare",
         "versions": {"stable": {"endpoints": [{"address": "127.0.0.1:8000"}]},
                      "canary": {"endpoints": [{"address": "127.0.0.1:8002"}]}}},
        {"name": "spare", "model": "s", "endpoints": [{"address": "127.0.0.1:8001"}]}]})
    routes = build_route_config(config, {"chat": 20.0},
                                admission=RouteAdmission(spill={"chat": 500}))
    plain = next(r for r in routes.virtual_hosts[0].routes if r.name == "body:chat")
    assert [(c.name, c.weight.value) for c in plain.route.weighted_clusters.clusters] == [
        ("chat-with-fallback", 400), ("spare", 400), ("chat-canary", 200)]
    canary = next(r for r in routes.virtual_hosts[0].routes if r.name == "body:chat:canary")
    assert canary.route.cluster == "chat-canary"  # a forced version never spills


def test_the_state_spills_a_pressed_pool_with_a_fallback_only() -> None:
    full = EndpointWeight(50, False, False, {"running": 8.0, "queue": 30.0}, 0.0, "ok", HEALTHY,
                          {"service_rate_used": 2000.0, "work_per_request": 1000.0})
    weights = {"chat": PoolWeights({"127.0.0.1:8000": full}, fail_static=False)}
    first = next_state(_fallback_config(), weights, AdmissionState(), lambda pool: 1)
    second = next_state(_fallback_config(), weights, first, lambda pool: 1)
    assert first.spill == {"chat": 100} and second.spill == {"chat": 200}
    assert second.routes(_fallback_config()).spill == {"chat": 200}
    off = _fallback_config(admission={"spill_to_fallback": False})
    assert next_state(off, weights, AdmissionState(), lambda pool: 1).spill == {}
    assert next_state(_config(), weights, AdmissionState(), lambda pool: 1).spill == {}
