"""The simulated server's wire formats: SSE, JSON, /metrics, ORCA headers, faults."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import EXAMPLES
from trimtab_dev.sim.fleet import FleetError, SimFleet, parse_fleet
from trimtab_dev.sim.server import ORCA_HEADER

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SPEC = {
    "model": MODEL,
    "servers": [
        {"name": "h", "gpu": "H100-80G"},
        {"name": "l", "gpu": "L4-24G", "max_model_len": 32768},
        {"name": "dead", "gpu": "A100-40G", "faults": {"dead": True}},
        {"name": "cold", "gpu": "A100-40G", "faults": {"cold_start_s": 600}},
    ],
}
VLLM_NAMES = {
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success", "vllm:cache_config_info",
}
DCGM_NAMES = {"DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_GPU_UTIL"}
ORCA_FIELDS = {"application_utilization", "cpu_utilization", "mem_utilization",
               "rps_fractional", "eps"}

Scenario = Callable[[SimFleet, aiohttp.ClientSession], Awaitable[Any]]


def with_fleet(scenario: Scenario, spec: dict | None = None) -> Any:
    async def main() -> Any:
        async with SimFleet(spec or SPEC) as fleet, aiohttp.ClientSession() as session:
            return await scenario(fleet, session)
    return asyncio.run(main())


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body per the spec: events end at a blank line; data lines join."""
    events: list[str] = []
    data: list[str] = []
    for line in raw.decode().split("\n"):
        line = line.rstrip("\r")
        if not line:
            if data:
                events.append("\n".join(data))
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        else:
            raise AssertionError(f"unexpected SSE line {line!r}")
    assert not data, "stream ended inside an event"
    return events


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, bytes]:
    async with session.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def parse_orca(value: str) -> dict[str, float]:
    assert value.startswith("TEXT ")
    out: dict[str, float] = {}
    for pair in value[5:].split(","):
        key, _, num = pair.strip().partition("=")
        assert key and num and key not in out
        out[key] = float(num)
    return out


def test_streaming_completion_is_openai_sse() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}, "prompt_tokens": 300}
        status, headers, raw = await post(s, fleet.urls["h"] + "/v1/completions", body)
        assert status == 200
        assert headers["Content-Type"].startswith("text/event-stream")
        assert raw.endswith(b"\n\n")
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c for c in chunks if c["choices"]]
        assert len(texts) == 5
        assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
        assert len({c["id"] for c in chunks}) == 1
        assert [c["choices"][0]["finish_reason"] for c in texts] == [None] * 4 + ["length"]
        assert chunks[-1]["usage"] == {"prompt_tokens": 300, "completion_tokens": 5,
                                       "total_tokens": 305}
    with_fleet(scenario)


def test_streaming_chat_starts_with_role_delta() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 400}],
                "max_tokens": 3, "stream": True}
        status, _, raw = await post(s, fleet.urls["h"] + "/v1/chat/completions", body)
        assert status == 200
        events = sse_events(raw)
        chunks = [json.loads(e) for e in events[:-1]]
        assert events[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:]]
        assert len(contents) == 3 and all(contents)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert not any("usage" in c for c in chunks)  # not asked for
    with_fleet(scenario)


def test_unary_response_has_usage_and_prompt_estimate() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "y" * 400}],
                "max_tokens": 4}
        status, headers, raw = await post(s, fleet.urls["h"] + "/v1/chat/completions", body)
        assert status == 200 and headers["x-sim-server"] == "h"
        data = json.loads(raw)
        assert data["object"] == "chat.completion"
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"] == {"prompt_tokens": 100, "completion_tokens": 4,
                                 "total_tokens": 104}
    with_fleet(scenario)


def test_metrics_parse_and_carry_every_name() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> str:
        await post(s, fleet.urls["h"] + "/v1/completions",
                   {"model": MODEL, "prompt": "a", "max_tokens": 3, "prompt_tokens": 50})
        async with s.get(fleet.urls["h"] + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    text = with_fleet(scenario)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families.keys() >= VLLM_NAMES | DCGM_NAMES
    samples = {s.name: s for f in families.values() for s in f.samples}
    assert samples["vllm:generation_tokens_total"].value == 3
    assert samples["vllm:prompt_tokens_total"].value == 50
    assert samples["vllm:request_success_total"].value == 1
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:inter_token_latency_seconds_count"].value == 2
    assert samples["vllm:kv_cache_usage_perc"].labels["model_name"] == MODEL
    info = samples["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16"
    blocks = int(info.labels["num_gpu_blocks"])
    assert 25_000 < blocks < 32_000  # ~454k tokens on an H100 80GB
    used, free = samples["DCGM_FI_DEV_FB_USED"], samples["DCGM_FI_DEV_FB_FREE"]
    assert used.value / (used.value + free.value) == pytest.approx(0.9, abs=0.001)
    assert used.labels["gpu"] == "0" and used.labels["UUID"].startswith("GPU-")
    assert used.labels["modelName"] == "NVIDIA H100 80GB HBM3"


def test_metrics_page_reads_through_trimtab_adapter() -> None:
    from xds_server.telemetry.parsers import parse_page

    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> tuple[str, int]:
        async with s.get(fleet.urls["l"] + "/metrics") as resp:
            return await resp.text(), fleet.servers["l"].engine.kv_capacity_tokens

    text, capacity = with_fleet(scenario)
    reading = parse_page(text)
    assert reading.server == "vllm" and not reading.problems
    assert reading.kv_capacity_tokens == capacity
    assert reading.gpu_mem_pct == pytest.approx(90.0, abs=0.1)


def test_orca_header_is_envoy_text_format() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> list[str]:
        values = []
        for stream in (True, False):  # a stream's headers leave while it is still queued
            _, headers, _ = await post(s, fleet.urls["h"] + "/v1/completions",
                                       {"model": MODEL, "prompt": "a", "max_tokens": 2,
                                        "stream": stream})
            values.append(headers[ORCA_HEADER])
        return values

    first, second = with_fleet(scenario)
    for value in (first, second):
        report = parse_orca(value)
        assert report.keys() >= ORCA_FIELDS
        for key, num in report.items():
            assert key in ORCA_FIELDS or key.startswith("named_metrics."), key
            assert math.isfinite(num) and num >= 0
        assert report["mem_utilization"] <= 1.0
    assert parse_orca(first)["application_utilization"] > 0  # the request itself is queued
    assert parse_orca(first)["named_metrics.num_requests_waiting"] == 1
    assert parse_orca(second)["rps_fractional"] > 0  # both requests have completed


def test_orca_utilization_source_is_selectable() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> str:
        _, headers, _ = await post(s, fleet.urls["h"] + "/v1/completions",
                                   {"model": MODEL, "prompt": "a", "max_tokens": 2,
                                    "stream": True})
        return headers[ORCA_HEADER]

    one: list[dict[str, Any]] = [{"name": "h", "gpu": "H100-80G"}]
    report = parse_orca(with_fleet(scenario, {"orca_utilization": "none", "servers": one}))
    assert "application_utilization" not in report and "cpu_utilization" in report
    with pytest.raises(KeyError):
        with_fleet(scenario, {"orca": False, "servers": one})


def test_errors_follow_vllm() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        url = fleet.urls["l"] + "/v1/completions"
        status, headers, raw = await post(s, url, {"model": MODEL, "prompt": "a",
                                                   "prompt_tokens": 32_700, "max_tokens": 500})
        assert status == 400 and json.loads(raw)["object"] == "error"
        assert ORCA_HEADER in headers
        status, _, raw = await post(s, url, {"model": "other", "prompt": "a"})
        assert status == 404 and "does not exist" in json.loads(raw)["message"]
        status, _, _ = await post(s, url, {"model": MODEL, "prompt": 5})
        assert status == 400
    with_fleet(scenario)


def test_dead_and_cold_servers() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(fleet.urls["dead"] + "/health")
        async with s.get(fleet.urls["cold"] + "/health") as resp:
            assert resp.status == 503
        status, _, _ = await post(s, fleet.urls["cold"] + "/v1/completions",
                                  {"model": MODEL, "prompt": "a"})
        assert status == 503
        async with s.get(fleet.urls["h"] + "/health") as resp:
            assert resp.status == 200
        async with s.get(fleet.urls["h"] + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == MODEL
    with_fleet(scenario)


def test_kill_drops_streams_and_revive_serves_again() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> None:
        url = fleet.urls["l"]
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2000, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first token arrived
            await fleet.kill("l")
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(url + "/health")
        await fleet.revive("l")
        async with s.get(url + "/health") as resp:
            assert resp.status == 200
    with_fleet(scenario)


def test_sim_stats_reports_loop_and_servers() -> None:
    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> dict:
        await asyncio.sleep(0.12)  # let the loop monitor take a sample or two
        async with s.get(fleet.urls["h"] + "/sim/stats") as resp:
            return await resp.json()

    stats = with_fleet(scenario)
    for key in ("loop_lag_p50_ms", "loop_lag_p99_ms", "cpu_seconds", "in_flight"):
        assert stats[key] >= 0
    assert stats["loop_lag_samples"] >= 1
    assert {row["name"] for row in stats["servers"]} == {"h", "l", "dead", "cold"}


def test_fleet_spec_validation() -> None:
    with pytest.raises(FleetError, match="unknown gpu"):
        parse_fleet({"servers": [{"name": "x", "gpu": "TPU"}]})
    with pytest.raises(FleetError, match="duplicate"):
        parse_fleet({"servers": [{"name": "x", "gpu": "L4-24G"},
                                 {"name": "x", "gpu": "L4-24G"}]})
    with pytest.raises(FleetError):
        parse_fleet({"servers": [{"name": "x", "gpu": "L4-24G", "faults": {"slow": 0}}]})
    spec = parse_fleet({"servers": [{"name": "a", "gpu": "A100-40G", "count": 3}]})
    assert len(spec.servers) == 1 and spec.servers[0].count == 3


def test_example_fleets_load() -> None:

    from trimtab_dev.sim.fleet import expand, load_fleet

    root = EXAMPLES
    hetero = [c.gpu.name for c in expand(load_fleet(root / "fleet-hetero.yaml"))]
    homog = [c.gpu.name for c in expand(load_fleet(root / "fleet-homogeneous.yaml"))]
    assert len(set(hetero)) == 3 and len(hetero) == 6
    assert set(homog) == {"A100-40G"}


async def _openai_stream(base_url: str, chat: bool, max_tokens: int) -> list[Any]:
    """Every chunk the official ``openai`` client parses from one streamed request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    options: Any = {"include_usage": True}
    try:
        if chat:
            stream: Any = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * 400}],
                max_tokens=max_tokens, stream=True, stream_options=options)
        else:
            stream = await client.completions.create(
                model=MODEL, prompt="y" * 400, max_tokens=max_tokens, stream=True,
                stream_options=options)
        return [chunk async for chunk in stream]
    finally:
        await client.close()


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_official_openai_client_parses_the_stream(chat: bool) -> None:
    pytest.importorskip("openai")

    async def scenario(fleet: SimFleet, s: aiohttp.ClientSession) -> list[Any]:
        return await _openai_stream(fleet.urls["h"], chat, max_tokens=7)

    chunks = with_fleet(scenario)
    *body, usage_chunk = chunks
    with_choices = [c for c in body if c.choices]
    assert len(with_choices) == len(body)  # only the usage chunk has no choice (vLLM's way)
    if chat:
        assert with_choices[0].choices[0].delta.role == "assistant"
        texts = [c.choices[0].delta.content for c in with_choices[1:]]
    else:
        texts = [c.choices[0].text for c in with_choices]
    assert len(texts) == 7 and all(texts)
    assert [c.choices[0].finish_reason for c in with_choices][-2:] == [None, "length"]
    assert all(c.usage is None for c in body)  # usage only in the last chunk
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens,
            usage_chunk.usage.total_tokens) == (100, 7, 107)
    assert {c.id for c in chunks} == {chunks[0].id}


def test_a_server_may_override_the_fleets_efficiency_and_defaults_do_not_change() -> None:
    from trimtab_dev.sim.fleet import expand
    from trimtab_dev.sim.profiles import Efficiency

    plain = expand(parse_fleet({"servers": [{"name": "h", "gpu": "H100-80G"}]}))
    assert plain[0].efficiency == Efficiency()  # no override: the profile's defaults
    spec = parse_fleet({"efficiency": {"step_overhead_s": 0.001},
                        "servers": [{"name": "h", "gpu": "H100-80G", "efficiency": {"mfu": 0.08}},
                                    {"name": "l", "gpu": "L4-24G"}]})
    h, low = expand(spec)
    assert h.efficiency.mfu == 0.08 and h.efficiency.step_overhead_s == 0.001  # merged
    assert low.efficiency == Efficiency(step_overhead_s=0.001)  # the fleet's
    from trimtab_dev.sim.fleet import load_fleet

    prefill = expand(load_fleet("examples/fleet-hetero-prefill-heavy.yaml"))
    per_token = {c.gpu.name: 2 * c.model.params / (c.gpu.peak_flops * c.efficiency.mfu)
                 for c in prefill}
    h100 = next(v for k, v in per_token.items() if k.startswith("H100"))
    assert h100 == pytest.approx(0.2e-3, rel=0.01)
    assert next(v for k, v in per_token.items() if k.startswith("A100")) == \
        pytest.approx(1.7 * h100, rel=0.01)
    assert next(v for k, v in per_token.items() if k.startswith("L4")) == \
        pytest.approx(4 * h100, rel=0.01)
