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
