"""Admission in Envoy's resources (xds_server/envoy/admission.py): the RTDS layer of
circuit-breaker limits, the routes' priorities and Retry-After, and the 429."""

from __future__ import annotations

from google.protobuf import json_format

from weight_calculator.admission import PoolBudget
from xds_server.config.load import parse_config
from xds_server.control.admission import AdmissionState
from xds_server.envoy.admission import ClusterLimits, retry_after_seconds, runtime_layer
from xds_server.envoy.routes import build_route_config


def _config(**admission: object) -> object:
    pool = {"name": "chat", "model": "m", "endpoints": [{"address": "127.0.0.1:8000"}],
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
    routes = build_route_config(_config(), retry_after={"chat": 4}).virtual_hosts[0].routes
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
