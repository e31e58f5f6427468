"""Workload classes with request features (image parts, an intent prefix, a stream override)
and the vision-language model profile."""

from __future__ import annotations

import json

from tests.support.paths import EXAMPLES
from trimtab_dev.loadgen.workload import (
    build_schedule,
    load_workload,
    parse_workload,
    request_body,
    request_streams,
)
from trimtab_dev.sim.fleet import load_fleet
from trimtab_dev.sim.profiles import GPUS, MODELS, kv_capacity_tokens

BASE = {"rate": 5, "duration_s": 20, "seed": 3,
        "classes": [{"name": "chat", "weight": 1, "prompt_tokens": {"dist": "fixed", "value": 10},
                     "max_tokens": {"dist": "fixed", "value": 5}}]}


def test_a_class_without_features_sends_the_same_body_as_before() -> None:
    workload = parse_workload(BASE)
    body = json.loads(request_body(build_schedule(workload)[0], workload))
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert isinstance(body["messages"][0]["content"], str) and body["stream"] is True


def test_image_parts_prefix_and_stream_override_reach_the_body() -> None:
    workload = load_workload(EXAMPLES / "workload-tiers.yaml")
    seen = {}
    for planned in build_schedule(workload, duration=60):
        seen.setdefault(planned.cls, (json.loads(request_body(planned, workload)),
                                      request_streams(planned, workload)))
    image, _ = seen["image"]
    parts = image["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"]
    assert seen["code"][0]["messages"][0]["content"].startswith("Write a python function")
    assert seen["batch"][0]["stream"] is False and seen["batch"][1] is False
    assert "stream_options" not in seen["batch"][0]
    assert seen["long-generation"][0]["max_tokens"] > 4096
    assert seen["chat"][1] is True


def test_the_vision_language_profile_sizes_its_kv_cache() -> None:
    model = MODELS["qwen2-vl-7b"]
    assert model.kv_bytes_per_token == 57344  # 2 x 28 layers x 4 KV heads x 128 x 2 bytes
    # 56 KiB per token against Llama-3.1-8B's 128 KiB: more than twice the tokens on an H100
    assert kv_capacity_tokens(GPUS["H100-80G"], model) > \
        2 * kv_capacity_tokens(GPUS["H100-80G"], MODELS["llama-3.1-8b"])
    spec = load_fleet(EXAMPLES / "fleet-vl.yaml")
    assert spec.model_profile == "qwen2-vl-7b"
