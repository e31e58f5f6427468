"""Endpoint host names in a config: syntax-checked (RFC 1123, bounded) and never resolved by
validation; `discovery.dns` and its bounds."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from xds_server.config.addresses import hostname_problem
from xds_server.config.load import ConfigError, parse_config


def _config(*addresses: str, **extra: Any) -> dict[str, Any]:
    return {**extra, "pools": [{"name": "p", "model": "m",
                                "endpoints": [{"address": a} for a in addresses]}]}


def _problems(document: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    return caught.value.problems


def test_host_names_are_accepted_without_being_resolved(monkeypatch) -> None:
    def no_dns(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("validation must not resolve names")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    config = parse_config(_config("vllm-1.inference.svc:8000", "localhost:8001",
                                  "VM-7.example.com.:8000", "10.0.0.1:8000"))
    assert [ep.host_port.host for ep in config.pool("p").endpoints] == [
        "vllm-1.inference.svc", "localhost", "VM-7.example.com.", "10.0.0.1"]


@pytest.mark.parametrize(("host", "reason"), [
    ("a" * 64 + ".example", "a label of 64 characters (at most 63)"),
    (".".join(["a" * 63] * 3) + "." + "b" * 62, "a host name of 254 characters (at most 253)"),
    ("vllm_1.svc", "label 'vllm_1' is not 1..63 letters, digits and inner hyphens"),
    ("-vllm.svc", "label '-vllm' is not"),
    ("a..b", "label '' is not"),
    ("10.0.0.256", "a host name's last label is not all digits"),
])
def test_a_bad_host_name_is_refused_naming_the_endpoint(host: str, reason: str) -> None:
    [(path, message)] = _problems(_config(f"{host}:8000"))
    assert path == "pools[p].endpoints[0].address"
    assert message.startswith("expected an IP address or a DNS host name, got ")
    assert reason in message


def test_the_longest_names_and_labels_allowed_pass() -> None:
    assert hostname_problem(".".join(["a" * 63] * 3) + "." + "b" * 61) is None  # 253 chars
    assert hostname_problem("x" * 63 + ".") is None


def test_more_distinct_names_than_max_names_is_refused() -> None:
    names = [f"vllm-{i}.svc:8000" for i in range(3)]
    assert parse_config(_config(*names, discovery={"dns": {"max_names": 3}}))
    problems = _problems(_config(*names, "VLLM-0.svc.:8001", "vllm-3.svc:8000",
                                 discovery={"dns": {"max_names": 3}}))
    assert problems == [("discovery.dns.max_names",
                         "the endpoints name 4 distinct DNS hosts; at most 3 are resolved")]


def test_a_named_endpoints_metrics_url_must_name_the_same_host() -> None:
    document = _config("vllm.svc:8000")
    document["pools"][0]["endpoints"][0]["metrics_url"] = "http://VLLM.svc:9090/metrics"
    assert parse_config(document)
    document["pools"][0]["endpoints"][0]["metrics_url"] = "http://exporter.svc/metrics"
    [(path, message)] = _problems(document)
    assert path == "pools[p].endpoints[0].metrics_url"
    assert "must name the same host, got 'exporter.svc'" in message


def test_dns_settings_are_bounded() -> None:
    [(path, message)] = _problems(_config("10.0.0.1:80", discovery={"dns": {
        "refresh_seconds": 5, "timeout_seconds": 5}}))
    assert path == "discovery.dns"
    assert "timeout_seconds (5.0) must be below refresh_seconds (5.0)" in message
    for key, value in [("max_addresses_per_name", 0), ("max_names", 10_001),
                       ("timeout_seconds", 31), ("family", "ipx")]:
        [(path, _)] = _problems(_config("10.0.0.1:80", discovery={"dns": {key: value}}))
        assert path == f"discovery.dns.{key}"
