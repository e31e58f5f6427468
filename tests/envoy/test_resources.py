"""Generated CDS/RDS details that the fallback end-to-end test depends on."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.config.route.v3 import route_pb2
from envoy.extensions.retry.priority.previous_priorities.v3 import (
    previous_priorities_config_pb2 as previous_priorities,
)

from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.envoy.clusters import build_clusters
from xds_server.envoy.routes import build_route_config

HEALTH = {"path": "/ready", "interval_seconds": 0.25, "timeout_seconds": 0.5}


def _config(**primary: Any) -> Config:
    return parse_config({"pools": [
        {"name": "big", "model": "m-big", "endpoints": [{"address": "10.0.0.1:80"}], **primary},
        {"name": "small", "model": "m-small", "endpoints": [{"address": "10.0.0.2:80"}]}]})


def _route(config: Config, name: str) -> route_pb2.RouteAction:
    routes = build_route_config(config).virtual_hosts[0].routes
    return next(route.route for route in routes if route.name == name)


def test_health_checks_run_at_the_interval_before_any_traffic() -> None:
    big = _config(health_check=HEALTH).pool("big")
    check, = build_clusters(big)[0].health_checks
    assert check.http_health_check.path == "/ready"
    assert check.interval.ToMilliseconds() == 250
    # Envoy's default for a cluster without traffic yet is 60 s, and that timer stays armed
    assert check.no_traffic_interval.ToMilliseconds() == 250
    assert not build_clusters(_config().pool("big"))[0].health_checks


def test_retries_of_a_pool_with_fallback_skip_priorities_already_tried() -> None:
    config = _config(fallback="small")
    action = _route(config, "body:big")
    assert action.cluster == "big-with-fallback"
    priority = action.retry_policy.retry_priority
    assert priority.name == "envoy.retry_priorities.previous_priorities"
    unpacked = previous_priorities.PreviousPrioritiesConfig()
    assert priority.typed_config.Unpack(unpacked) and unpacked.update_frequency == 1
    assert not _route(config, "body:small").retry_policy.HasField("retry_priority")
    assert not _route(_config(), "body:big").retry_policy.HasField("retry_priority")


def test_active_request_bias_reaches_the_least_request_config() -> None:
    from xds_server.config.load import ConfigError, parse_config
    from xds_server.envoy.clusters import build_cluster

    config = parse_config({"pools": [{"name": "p", "model": "m", "active_request_bias": 0.0,
                                      "lb_policy": "least_request",
                                      "endpoints": [{"address": "10.0.0.1:80"}]}]})
    cluster = build_cluster(config.pools[0], "p")
    assert cluster.least_request_lb_config.HasField("active_request_bias")
    assert cluster.least_request_lb_config.active_request_bias.default_value == 0.0
    plain = parse_config({"pools": [{"name": "p", "model": "m", "lb_policy": "least_request",
                                     "endpoints": [{"address": "10.0.0.1:80"}]}]})
    assert not build_cluster(plain.pools[0], "p").least_request_lb_config.HasField(
        "active_request_bias")
    with pytest.raises(ConfigError, match="active_request_bias"):
        parse_config({"pools": [{"name": "p", "model": "m", "lb_policy": "round_robin",
                                 "active_request_bias": 0.0,
                                 "endpoints": [{"address": "10.0.0.1:80"}]}]})
