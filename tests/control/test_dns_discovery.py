"""Endpoints addressed by DNS name (xds_server/control/discovery/dns.py and merge.py): unit
tests with an injected resolver (a fake getaddrinfo and a fake clock, never real DNS), and one
slow test through `trimtab serve` with `localhost` resolved by the system resolver."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse
from prometheus_client import REGISTRY

from tests.support.backends import BackendFleet
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import free_port
from xds_server.config.load import parse_config
from xds_server.config.schema import DnsDiscoveryConfig
from xds_server.control.controller import Controller
from xds_server.control.discovery.dns import DnsResolver, resolved_endpoints
from xds_server.control.discovery.merge import Discovery, effective_config
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache


class FakeDns:
    """getaddrinfo from a table: name -> IPs, or an exception to raise. Counts calls."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = dict(table)
        self.calls: list[str] = []
        self.families: list[int] = []

    def __call__(self, host: str, port: Any, family: int = 0, type_: int = 0,
                 proto: int = 0) -> list[tuple[Any, ...]]:
        self.calls.append(host)
        self.families.append(family)
        answer = self.table.get(host, socket.gaierror(socket.EAI_NONAME, "Name or service "
                                                                         "not known"))
        if isinstance(answer, BaseException):
            raise answer
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, 0, 0, 0) if ":" in ip else (ip, 0)) for ip in answer]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _resolver(table: dict[str, Any], **settings: Any) -> tuple[DnsResolver, FakeDns, Clock]:
    fake, clock = FakeDns(table), Clock()
    return DnsResolver(DnsDiscoveryConfig(**settings), getaddrinfo=fake, clock=clock), fake, clock


def _sample(metric: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(metric, labels)


def _count(metric: str, **labels: str) -> float:
    return _sample(metric, **labels) or 0.0


def _refresh(resolver: DnsResolver, *names: str) -> bool:
    async def body() -> bool:
        try:
            return await resolver.refresh(names)
        finally:
            resolver.close()
    return asyncio.run(body())


NAMED = {"pools": [{"name": "p", "model": "m", "telemetry_source": "static", "endpoints": [
    {"address": "vllm.inference.svc:8000", "metrics_url": "http://vllm.inference.svc:9090/m",
     "signals": {"kv_cache_usage": 0.5}, "capacity": 4096},
    {"address": "10.0.0.9:8000", "signals": {"kv_cache_usage": 0.5}}]}]}


def test_every_address_of_a_name_is_its_own_endpoint_with_its_own_metrics_url() -> None:
    resolver, fake, _ = _resolver({"vllm.inference.svc": ["10.0.0.2", "fd00::7", "10.0.0.1",
                                                          "10.0.0.2"]})
    assert _refresh(resolver, "vllm.inference.svc") is True
    assert resolver.resolved() == {"vllm.inference.svc": ("10.0.0.1", "10.0.0.2", "fd00::7")}
    assert fake.calls == ["vllm.inference.svc"] and fake.families == [socket.AF_UNSPEC]
    config = effective_config(parse_config(NAMED), {}, resolver.resolved())
    endpoints = config.pool("p").endpoints
    assert [ep.address for ep in endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000",
                                                "[fd00::7]:8000", "10.0.0.9:8000"]
    assert [ep.scrape_url for ep in endpoints] == [
        "http://10.0.0.1:9090/m", "http://10.0.0.2:9090/m", "http://[fd00::7]:9090/m",
        "http://10.0.0.9:8000/metrics"]
    assert {ep.capacity for ep in endpoints[:3]} == {4096}  # every other key kept


def test_resolved_endpoints_flow_through_reconcile_into_eds_and_weights() -> None:
    base = parse_config(NAMED)

    async def body() -> None:
        resolver, fake, _ = _resolver({"vllm.inference.svc": ["10.0.0.1", "10.0.0.2"]})
        cache = SnapshotCache()
        discovery = Discovery(lambda config: None, dns=resolver)
        controller = Controller(discovery.effective(base), cache)
        assert [ep.address for ep in controller.config.pool("p").endpoints] == ["10.0.0.9:8000"]
        discovery.on_change = controller.reconcile  # what Trimtab wires discovery to
        discovery.start(base)
        try:
            assert await discovery.dns_settled(5.0)
            cla = cache.snapshot.of_type(T.ENDPOINT)["p"].message
            eds = {lb.endpoint.address.socket_address.address
                   for locality in cla.endpoints for lb in locality.lb_endpoints}
            assert eds == {"10.0.0.1", "10.0.0.2", "10.0.0.9"}
            await controller.tick()
            assert set(controller.weights["p"].endpoints) == {"10.0.0.1:8000", "10.0.0.2:8000",
                                                               "10.0.0.9:8000"}
        finally:
            await discovery.close()
            resolver.close()
            await controller.close()
        assert fake.calls == ["vllm.inference.svc"]

    asyncio.run(body())


def test_a_failure_keeps_the_last_good_addresses_then_drops_them_after_the_bound(caplog) -> None:
    resolver, fake, clock = _resolver({"a.example": ["10.1.0.1", "10.1.0.2"]},
                                      refresh_seconds=30, retry_seconds=5, stale_seconds=60)
    caplog.set_level(logging.WARNING, logger="xds_server.control.discovery.dns")

    async def body() -> None:
        try:
            assert await resolver.refresh(["a.example"]) is True
            fake.table["a.example"] = socket.gaierror(socket.EAI_AGAIN, "Temporary failure")
            clock.now += 30
            assert await resolver.refresh(["a.example"]) is False  # kept: 30 s old
            assert resolver.names["a.example"].stale
            assert _sample("trimtab_dns_stale", name="a.example") == 1
            assert "keeping its last good addresses (10.1.0.1, 10.1.0.2)" in caplog.text
            clock.now += 30
            assert await resolver.refresh(["a.example"]) is False  # 60 s old: still kept
            assert resolver.resolved() == {"a.example": ("10.1.0.1", "10.1.0.2")}
            clock.now += 5
            assert await resolver.refresh(["a.example"]) is True  # 65 s > 60: dropped
            assert resolver.resolved() == {}
            assert _sample("trimtab_dns_addresses", name="a.example") == 0
            assert "its endpoints are dropped" in caplog.text
            fake.table["a.example"] = ["10.1.0.3"]
            clock.now += 5
            assert await resolver.refresh(["a.example"]) is True
            assert resolver.resolved() == {"a.example": ("10.1.0.3",)}
            assert _sample("trimtab_dns_stale", name="a.example") == 0
        finally:
            resolver.close()

    asyncio.run(body())
    assert len(fake.calls) == 5


def test_a_name_that_never_resolves_gets_no_endpoint_a_warning_and_a_metric(caplog) -> None:
    resolver, _, _ = _resolver({})
    caplog.set_level(logging.WARNING, logger="xds_server.control.discovery.dns")
    errors = _count("trimtab_dns_lookups_total", result="error")
    assert _refresh(resolver, "vllm.inference.svc") is False
    assert resolver.resolved() == {}
    assert resolver.names["vllm.inference.svc"].error.startswith("gaierror")
    assert "DNS name vllm.inference.svc does not resolve" in caplog.text
    assert _sample("trimtab_dns_addresses", name="vllm.inference.svc") == 0
    assert _count("trimtab_dns_lookups_total", result="error") == errors + 1
    config = effective_config(parse_config(NAMED), {}, resolver.resolved())
    assert [ep.address for ep in config.pool("p").endpoints] == ["10.0.0.9:8000"]


def test_addresses_over_the_cap_and_unroutable_answers_are_not_kept(caplog) -> None:
    many = [f"10.2.0.{i}" for i in range(9, 0, -1)]
    resolver, _, _ = _resolver({"big.example": many, "meta.example": ["169.254.169.254",
                                                                       "0.0.0.0"]},
                               max_addresses_per_name=3)
    caplog.set_level(logging.WARNING, logger="xds_server.control.discovery.dns")
    _refresh(resolver, "big.example", "meta.example")
    assert resolver.resolved() == {"big.example": ("10.2.0.1", "10.2.0.2", "10.2.0.3")}
    assert "resolved to 9 addresses; keeping the first 3" in caplog.text
    assert "no usable address: refused 169.254.169.254" in resolver.names["meta.example"].error


def test_names_are_re_resolved_on_their_schedule_and_forgotten_when_gone() -> None:
    resolver, fake, clock = _resolver({"a.example": ["10.3.0.1"]}, refresh_seconds=30,
                                      retry_seconds=5)

    async def body() -> None:
        try:
            await resolver.refresh(["a.example", "b.example"])
            assert sorted(fake.calls) == ["a.example", "b.example"]
            clock.now += 4.9
            await resolver.refresh(["a.example", "b.example"])
            assert len(fake.calls) == 2  # nothing due
            clock.now += 0.1
            await resolver.refresh(["a.example", "b.example"])
            assert fake.calls[2:] == ["b.example"]  # the failed one: after retry_seconds
            assert resolver.next_due() == pytest.approx(clock.now + 5)
            clock.now = 1030.0
            await resolver.refresh(["a.example", "b.example"])
            assert sorted(fake.calls[3:]) == ["a.example", "b.example"]  # a: refresh_seconds
            await resolver.refresh(["a.example"])
            assert set(resolver.names) == {"a.example"}
            assert REGISTRY.get_sample_value("trimtab_dns_addresses",
                                             {"name": "b.example"}) is None
        finally:
            resolver.close()

    asyncio.run(body())


def test_a_hung_lookup_times_out_and_is_never_started_twice() -> None:
    release = threading.Event()
    fake = FakeDns({"slow.example": ["10.4.0.1"]})

    def hanging(host: str, *args: Any) -> list[tuple[Any, ...]]:
        release.wait(5)
        return fake(host, *args)

    clock = Clock()
    resolver = DnsResolver(DnsDiscoveryConfig(timeout_seconds=0.05, retry_seconds=1),
                           getaddrinfo=hanging, clock=clock)
    timeouts = _count("trimtab_dns_lookups_total", result="timeout")
    busy = _count("trimtab_dns_lookups_total", result="busy")

    async def body() -> None:
        try:
            await resolver.refresh(["slow.example"])
            assert resolver.names["slow.example"].error == "no answer within 0.05s"
            clock.now += 1
            await resolver.refresh(["slow.example"])  # the first is still running
            assert resolver.names["slow.example"].error == "the previous lookup is still running"
            release.set()
            await asyncio.sleep(0.2)
            clock.now += 1
            await resolver.refresh(["slow.example"])
            assert resolver.resolved() == {"slow.example": ("10.4.0.1",)}
        finally:
            release.set()
            resolver.close()

    asyncio.run(body())
    assert _count("trimtab_dns_lookups_total", result="timeout") == timeouts + 1
    assert _count("trimtab_dns_lookups_total", result="busy") == busy + 1
    assert fake.calls == ["slow.example", "slow.example"]


def test_family_setting_is_passed_to_getaddrinfo() -> None:
    resolver, fake, _ = _resolver({"a.example": ["10.5.0.1"]}, family="ipv4")
    _refresh(resolver, "a.example")
    assert fake.families == [socket.AF_INET]


def test_canary_endpoints_by_name_expand_in_their_version_and_ips_stay_as_they_are() -> None:
    config = parse_config({"pools": [{"name": "q", "model": "m", "versions": {
        "stable": {"endpoints": [{"address": "stable.example:80"}]},
        "canary": {"endpoints": [{"address": "canary.example:80"},
                                 {"address": "10.6.0.1:80"}]}}}]})
    resolved = {"stable.example": ("10.6.0.1", "10.6.0.2"), "canary.example": ("10.6.0.1",)}
    pool = effective_config(config, {}, resolved).pool("q")
    assert [ep.address for ep in pool.versions["stable"].endpoints] == ["10.6.0.1:80",
                                                                        "10.6.0.2:80"]
    assert [ep.address for ep in pool.versions["canary"].endpoints] == ["10.6.0.1:80"]
    ip = config.pool("q").versions["canary"].endpoints[1]
    assert resolved_endpoints(ip, resolved) == [ip]


# -- through `trimtab serve`: `localhost` as a name, resolved by the system resolver ---------

def _eds_over_ads(xds: str, cluster: str) -> dict[str, int]:
    """The ClusterLoadAssignment `cluster` as `IP:port -> load_balancing_weight`, asked for
    over a SotW ADS stream like an Envoy would."""
    with grpc.insecure_channel(xds) as channel:
        call = channel.stream_stream(
            "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources",
            request_serializer=DiscoveryRequest.SerializeToString,
            response_deserializer=DiscoveryResponse.FromString)
        requests = iter([DiscoveryRequest(node={"id": "dns-test", "cluster": "edge"},
                                          type_url=T.ENDPOINT, resource_names=[cluster])])
        responses = call(requests, timeout=10)
        response = next(responses)
        responses.cancel()
    found = {}
    for resource in response.resources:
        cla = ClusterLoadAssignment()
        resource.Unpack(cla)
        if cla.cluster_name == cluster:
            for locality in cla.endpoints:
                for lb in locality.lb_endpoints:
                    socket_address = lb.endpoint.address.socket_address
                    host = socket_address.address
                    key = f"[{host}]" if ":" in host else host
                    found[f"{key}:{socket_address.port_value}"] = lb.load_balancing_weight.value
    return found


@pytest.mark.slow
def test_serve_resolves_localhost_into_an_endpoint_in_weights_and_eds(tmp_path) -> None:
    root = Path(__file__).resolve().parents[2]
    with BackendFleet(count=1) as fleet:
        fleet.set_vllm(0)
        port = fleet.ports[0]
        admin, xds = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        config = {"xds": {"address": xds}, "admin": {"address": admin},
                  "listener": {"address": f"127.0.0.1:{free_port()}"},
                  "telemetry": {"interval_seconds": 0.5},
                  "rollouts": {"state_file": str(tmp_path / "rollouts.json")},
                  "discovery": {"dns": {"refresh_seconds": 5, "timeout_seconds": 2}},
                  "pools": [{"name": "named", "model": "m",
                             "endpoints": [{"address": f"localhost:{port}"}]}]}
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        proc = subprocess.Popen([sys.executable, "-m", "xds_server.cli", "--log-level",
                                 "warning", "serve", "--config", str(path)], cwd=root)
        ipv4, ipv6 = f"127.0.0.1:{port}", f"[::1]:{port}"  # /etc/hosts may give both
        try:
            def weights() -> dict[str, Any]:
                assert proc.poll() is None, "trimtab serve exited"
                try:
                    with urllib.request.urlopen(f"http://{admin}/v1/weights", timeout=2) as r:
                        return json.load(r)["pools"].get("named", {})
                except OSError:
                    return {}

            # the IPv4 address is read at its own IP: not stale once its page was scraped
            found = wait_until(weights, 30, "localhost's endpoint read in /v1/weights",
                               check=lambda w: ipv4 in w and not w[ipv4]["stale"], every=0.1)
            assert set(found) <= {ipv4, ipv6}
            assert fleet.scrape_count(0) > 0
            eds = _eds_over_ads(xds, "named")
            assert ipv4 in eds and set(eds) == set(found)
            assert eds[ipv4] >= 1
        finally:
            proc.terminate()
            proc.wait(15)
