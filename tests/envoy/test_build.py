"""envoy.build: every resource from (config, canary shares, auto classes, weights), pure."""

from __future__ import annotations

from weight_calculator.types import EndpointWeight, PoolWeights
from xds_server.config.load import parse_config
from xds_server.envoy.build import (
    build_resources,
    config_resources,
    eds_health,
    eds_priority,
    endpoint_settings,
    route_resources,
)
from xds_server.xds import type_urls as T

CONFIG = parse_config({"pools": [{
    "name": "p", "model": "m",
    "versions": {"stable": {"endpoints": [{"address": "10.0.0.1:80"}]},
                 "canary": {"endpoints": [{"address": "10.0.0.2:80"}]}}}]})


def _weights(stable: int, canary: int, health: str = "HEALTHY") -> dict[str, PoolWeights]:
    def one(weight: int) -> EndpointWeight:
        return EndpointWeight(weight, False, False, {}, 1.0, "ok", health)
    return {"p": PoolWeights({"10.0.0.1:80": one(stable)}, False),
            "p-canary": PoolWeights({"10.0.0.2:80": one(canary)}, False)}


def _bytes(resources: dict) -> dict[str, list[bytes]]:
    return {t: [m.SerializeToString(deterministic=True) for m in ms] for t, ms in resources.items()}


def test_the_same_inputs_give_the_same_bytes_and_weights_touch_only_eds() -> None:
    static, routing = config_resources(CONFIG), route_resources(CONFIG, {"p": 20.0}, {})
    first = build_resources(static, routing, _weights(50, 10))
    again = build_resources(config_resources(CONFIG), route_resources(CONFIG, {"p": 20.0}, {}),
                            _weights(50, 10))
    assert _bytes(first) == _bytes(again)
    moved = build_resources(static, routing, _weights(70, 10))
    assert _bytes(moved)[T.ENDPOINT] != _bytes(first)[T.ENDPOINT]
    for kind in (T.CLUSTER, T.LISTENER, T.ROUTE):
        assert [id(m) for m in moved[kind]] == [id(m) for m in first[kind]]  # built once


def test_routes_follow_the_canary_share() -> None:
    static = config_resources(CONFIG)
    none, twenty = route_resources(CONFIG, {}, {}), route_resources(CONFIG, {"p": 20.0}, {})
    assert twenty.built_from(CONFIG, {"p": 20.0}, {}) and not twenty.built_from(CONFIG, {}, {})
    a = build_resources(static, none, _weights(50, 10))[T.ROUTE][0]
    b = build_resources(static, twenty, _weights(50, 10))[T.ROUTE][0]
    assert a.SerializeToString(deterministic=True) != b.SerializeToString(deterministic=True)


def test_eds_health_carries_degraded_and_standby_is_priority_one() -> None:
    assert eds_health("DEGRADED") == "DEGRADED"
    assert {eds_health(h) for h in ("HEALTHY", "STALE", "INVALID", "WARMING", "STANDBY")} == {
        "HEALTHY"}
    assert (eds_priority("STANDBY"), eds_priority("HEALTHY"), eds_priority("DEGRADED")) == (
        1, 0, 0)
    settings = endpoint_settings(_weights(5, 1, health="STANDBY"))
    assert settings["p"]["10.0.0.1:80"].weight == 5
    assert (settings["p"]["10.0.0.1:80"].health, settings["p"]["10.0.0.1:80"].priority) == (
        "HEALTHY", 1)
    # a cluster whose every endpoint is on standby serves from them (priority 0)
    static = config_resources(CONFIG)
    cla = build_resources(static, route_resources(CONFIG, {}, {}),
                          _weights(5, 1, health="STANDBY"))[T.ENDPOINT][0]
    assert [loc.priority for loc in cla.endpoints] == [0]


def test_capacity_tiers_reach_eds_as_weighted_localities_and_the_cluster_uses_them() -> None:
    config = parse_config({"pools": [{"name": "p", "model": "m", "endpoints": [
        {"address": a} for a in ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80")]}]})

    def ew(locality: str | None, health: str = "HEALTHY") -> EndpointWeight:
        return EndpointWeight(100, False, False, {}, 1.0, "ok", health, locality=locality)

    weights = {"p": PoolWeights({"10.0.0.1:80": ew("kv9"), "10.0.0.2:80": ew("kv9"),
                                 "10.0.0.3:80": ew("kv3", "STANDBY")}, False,
                                localities={"kv9": 100, "kv3": 1})}
    static = config_resources(config)
    resources = build_resources(static, route_resources(config, {}, {}), weights)
    cla, = resources[T.ENDPOINT]
    # priority 0 first: the serving tier; the standby tier is priority 1, failover only
    assert [(loc.priority, loc.locality.zone, loc.load_balancing_weight.value,
             [lb.endpoint.address.socket_address.address for lb in loc.lb_endpoints])
            for loc in cla.endpoints] == [(0, "kv9", 100, ["10.0.0.1", "10.0.0.2"]),
                                          (1, "kv3", 1, ["10.0.0.3"])]
    assert cla.endpoints[1].lb_endpoints[0].health_status == 1  # HEALTHY
    cluster, = resources[T.CLUSTER]
    assert cluster.common_lb_config.HasField("locality_weighted_lb_config")
    assert cluster.least_request_lb_config.choice_count.value == 8  # the pool's default
    # without tiers (another policy): one default locality of weight 1, as before
    plain = {"p": PoolWeights({a: ew(None) for a in ("10.0.0.1:80", "10.0.0.2:80")}, False)}
    cla, = build_resources(static, route_resources(config, {}, {}), plain)[T.ENDPOINT]
    assert [(loc.locality.zone, loc.load_balancing_weight.value, len(loc.lb_endpoints))
            for loc in cla.endpoints] == [("default", 1, 3)]
    assert endpoint_settings(weights)["p"]["10.0.0.1:80"].locality_weight == 100
