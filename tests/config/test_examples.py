"""The shipped examples use the defaults unless they show something on purpose (issue 25,
item 6): examples/local.yaml, the README's config for your own servers, is on the default
policy and balancer; the small demo's examples/local-fake-gpus.yaml differs from it only in
the two keys its DCGM-only fake backends need, and says so."""

from __future__ import annotations

from pathlib import Path

import yaml

from trimtab_dev.demo.local import DEFAULT_CONFIG
from xds_server.config.load import load_config
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import WeightsConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_local_example_uses_the_default_policy_and_balancer() -> None:
    config = load_config(EXAMPLES / "local.yaml")
    assert config.weights.policy == WeightsConfig().policy == "queueing"
    [pool] = config.pools
    assert pool.lb_policy == PoolConfig.model_fields["lb_policy"].default == "least_request"
    raw = yaml.safe_load((EXAMPLES / "local.yaml").read_text())
    assert "weights" not in raw and "lb_policy" not in raw["pools"][0]  # not even spelt out


def test_the_small_demo_changes_exactly_what_its_fake_backends_need_and_says_why() -> None:
    assert DEFAULT_CONFIG == EXAMPLES / "local-fake-gpus.yaml"
    local = yaml.safe_load((EXAMPLES / "local.yaml").read_text())
    demo = yaml.safe_load(DEFAULT_CONFIG.read_text())
    assert demo.pop("weights") == {"policy": "gpu_memory"}
    assert demo["pools"][0].pop("lb_policy") == "round_robin"
    assert demo == local  # same ports, pool and endpoints: the same envoy-bootstrap.yaml
    text = DEFAULT_CONFIG.read_text()
    assert "ON PURPOSE" in text and "Do not copy it" in text
    assert load_config(DEFAULT_CONFIG).weights.policy == "gpu_memory"
