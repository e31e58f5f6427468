"""Pools fed by Kubernetes EndpointSlices (fake API server speaking the real JSON shapes)."""

from __future__ import annotations

import asyncio

from tests.support.fake_kube import FakeKube, endpoint, endpoint_slice
from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.control.discovery.merge import Discovery
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache


def _config(host: str):
    return parse_config({"pools": [
        {"name": "k", "model": "m", "telemetry_source": "static",
         "discovery": {"kubernetes": {"namespace": "default", "service": "vllm",
                                      "port_name": "http", "api_server": host}}},
        {"name": "s", "model": "n", "endpoints": [{"address": "10.9.9.9:80"}]}]})


def _eds(cache: SnapshotCache, cluster: str) -> dict[str, int]:
    cla = cache.snapshot.of_type(T.ENDPOINT)[cluster].message
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            e.health_status for e in cla.endpoints[0].lb_endpoints}


def test_discovered_endpoints_reach_eds_and_follow_changes():
    with FakeKube() as kube:
        kube.apply(endpoint_slice("vllm-a", "vllm", [endpoint("10.1.0.1"), endpoint("10.1.0.2")]))

        async def body():
            base = _config(kube.host)
            cache = SnapshotCache()
            controller = Controller(base, cache)
            changed = asyncio.Event()

            def apply(config):
                controller.apply_config(config)
                controller.publish()
                changed.set()

            discovery = Discovery(apply)
            discovery.start(base)
            try:
                await asyncio.wait_for(changed.wait(), 10)
                assert set(_eds(cache, "k")) == {"10.1.0.1:8000", "10.1.0.2:8000"}
                changed.clear()
                kube.apply(endpoint_slice("vllm-a", "vllm", [
                    endpoint("10.1.0.1"), endpoint("10.1.0.2", ready=False, serving=True,
                                                   terminating=True), endpoint("10.1.0.3")]))
                await asyncio.wait_for(changed.wait(), 10)
                eds = _eds(cache, "k")
                assert set(eds) == {"10.1.0.1:8000", "10.1.0.2:8000", "10.1.0.3:8000"}
                assert eds["10.1.0.2:8000"] == 3  # DRAINING
                assert set(_eds(cache, "s")) == {"10.9.9.9:80"}  # static pools untouched
            finally:
                await discovery.close()
                await controller.close()

        asyncio.run(body())
