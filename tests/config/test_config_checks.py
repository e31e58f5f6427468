"""xds_server/config/checks.py and the pool references it follows (PoolConfig.dependencies)."""

from __future__ import annotations

from typing import Any

import pytest

from xds_server.config.checks import config_problems, node_pool_problems
from xds_server.config.load import ConfigError, parse_config


def _pool(name: str, host: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": f"model-{name}",
            "endpoints": [{"address": f"10.0.0.{host}:8000"}], **extra}


def _document(nodes: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Pool `a` reaches every other pool one way each: fallback, a prompt-size class, a
    request class, a model version and an intent tier."""
    a = _pool("a", 1, fallback="b", prompt_classes=[{"pool": "c", "min_prompt_bytes": 4096}],
              request_classes=[{"pool": "d", "modality": "image"}],
              model_versions={"pools": {"v2": "e"}}, intent_tiers={"hard": "f"})
    document: dict[str, Any] = {
        "classifier": {"rules": [{"tier": "hard", "keywords": ["prove"]}]},
        "pools": [a, *(_pool(name, host) for host, name in enumerate("bcdef", start=2))]}
    if nodes is not None:
        document["nodes"] = {"clusters": nodes}
    return document


def test_a_pool_depends_on_every_pool_it_sends_traffic_to() -> None:
    config = parse_config(_document())
    assert config.pool("a").request_targets() == {"d", "e", "f"}
    assert config.pool("a").dependencies() == {"b", "c", "d", "e", "f"}
    assert config.pool("b").dependencies() == set()


def test_a_node_given_a_pool_needs_every_pool_it_depends_on() -> None:
    config = parse_config(_document())
    assert node_pool_problems({"edge": ["a", "b", "c", "d", "e", "f"]}, config) == []
    assert node_pool_problems({"edge": ["a", "c"]}, config) == [
        ("nodes.clusters.edge", f"pool 'a' sends traffic to pool {dep!r} (fallback or size "
                                f"class); assign {dep!r} too") for dep in "bdef"]


def test_node_problems_fail_the_config_with_their_key_path() -> None:
    assert config_problems(parse_config(_document({"edge": list("abcdef")}))) == []
    with pytest.raises(ConfigError) as caught:
        parse_config(_document({"edge": ["a", "b", "c", "d", "e"]}))
    assert caught.value.problems == [
        ("nodes.clusters.edge", "pool 'a' sends traffic to pool 'f' (fallback or size class); "
                                "assign 'f' too")]


# --- one socket per listener ----------------------------------------------------------------


def _listening(**addresses: str | None) -> dict[str, Any]:
    document = _document()
    for key, address in addresses.items():
        section = document.setdefault(key, {})
        section["address"] = address
    return document


def _refusal(**addresses: str | None) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_config(_listening(**addresses))
    return caught.value.problems


def test_xds_admin_and_keda_on_one_port_name_both_fields() -> None:
    assert _refusal(xds="127.0.0.1:18000", admin="127.0.0.1:18000",
                    keda="127.0.0.1:18000") == [
        ("admin.address", "127.0.0.1:18000 and xds.address (127.0.0.1:18000) both listen on "
                          "port 18000; give each listener its own port"),
        ("keda.address", "127.0.0.1:18000 and xds.address (127.0.0.1:18000) both listen on "
                         "port 18000; give each listener its own port"),
        ("keda.address", "127.0.0.1:18000 and admin.address (127.0.0.1:18000) both listen on "
                         "port 18000; give each listener its own port")]


@pytest.mark.parametrize(("xds", "admin"), [
    ("0.0.0.0:18000", "127.0.0.1:18000"),   # the wildcard takes the port on every address
    ("10.1.2.3:18000", "[::]:18000"),
    ("[::1]:18000", "[0:0:0:0:0:0:0:1]:18000"),  # one address, two spellings
    ("LOCALHOST:18000", "localhost:18000"),
])
def test_a_wildcard_or_the_same_host_on_one_port_is_refused(xds: str, admin: str) -> None:
    problems = _refusal(xds=xds, admin=admin)
    assert [key for key, _ in problems] == ["admin.address"]
    assert "xds.address" in problems[0][1] and "port 18000" in problems[0][1]


def test_the_embedded_classifier_counts_only_while_it_listens() -> None:
    assert [key for key, _ in _refusal(classifier="127.0.0.1:19100")] == ["classifier.address"]
    document = _listening(classifier="127.0.0.1:19100")
    document["classifier"]["embedded"] = False  # `trimtab classify` listens elsewhere
    assert config_problems(parse_config(document)) == []
    document = _listening(classifier="127.0.0.1:18081")
    document["classifier"]["metrics_address"] = "0.0.0.0:18000"
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    assert [key for key, _ in caught.value.problems] == ["classifier.metrics_address"]


@pytest.mark.parametrize(("xds", "admin"), [
    ("127.0.0.1:18000", "127.0.0.1:18001"),
    ("127.0.0.1:18000", "127.0.0.2:18000"),
    ("127.0.0.1:18000", "[::1]:18000"),
])
def test_different_sockets_pass(xds: str, admin: str) -> None:
    assert config_problems(parse_config(_listening(xds=xds, admin=admin))) == []


# --- endpoint addresses that name no one host ------------------------------------------------


@pytest.mark.parametrize(("address", "why"), [
    ("0.0.0.0:8000", "unspecified"), ("[::]:8000", "unspecified"),
    ("169.254.169.254:80", "link-local"), ("[fe80::1]:8000", "link-local"),
    ("224.0.0.1:8000", "multicast"), ("[ff02::1]:8000", "multicast"),
    ("[::ffff:169.254.1.1]:8000", "link-local"),
])
def test_a_config_endpoint_that_names_no_host_is_a_config_error(address: str, why: str) -> None:
    document = _document()
    document["pools"][1]["endpoints"] = [{"address": address}]
    with pytest.raises(ConfigError) as caught:
        parse_config(document)
    [(key, reason)] = caught.value.problems
    assert key == "pools[b].endpoints[0].address"
    assert reason.startswith(f"{address!r}: ") and why in reason


@pytest.mark.parametrize("address", ["127.0.0.1:8000", "[::1]:8000", "10.0.0.9:8000"])
def test_loopback_and_ordinary_config_endpoints_pass(address: str) -> None:
    document = _document()
    document["pools"][1]["endpoints"] = [{"address": address}]
    assert config_problems(parse_config(document)) == []
