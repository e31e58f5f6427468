"""`trimtab weights`: the explanation table and JSON rows, from static and scraped telemetry."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from xds_server.config.load import parse_config
from xds_server.control.explain import collect_rows, explain

STATIC = parse_config({
    "telemetry": {"source": "static"},
    "weights": {"policy": "composite"},
    "pools": [{"name": "s", "model": "m", "endpoints": [
        {"address": "10.0.2.1:80",
         "signals": {"kv_usage": 0.5, "queue": 8, "kv_capacity_tokens": 20000}},
        {"address": "10.0.2.2:80", "capacity": 10000, "signals": {"kv_usage": 0.2, "queue": 0}},
        {"address": "10.0.2.3:80", "signals": {"kv_usage": -0.5, "queue": 16}},
    ]}],
})
COLUMNS = ["pool", "cluster", "endpoint", "locality", "weight", "health", "stale", "capacity",
           "capacity_tokens", "inputs", "normalised", "shares", "reason"]


def _table(text: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(header, endpoint -> cells, notes); cells are split on runs of 2+ spaces."""
    lines = text.splitlines()
    notes = [line for line in lines if line.startswith("note: ")]
    cells = [[c.strip() for c in line.split("  ") if c.strip()]
             for line in lines if not line.startswith("note: ")]
    return cells[0], {row[2]: row for row in cells[1:]}, notes


def test_static_table_shows_relative_and_token_capacity_side_by_side() -> None:
    header, rows, notes = _table(explain(STATIC))
    assert header == COLUMNS and notes == []  # no ITL histogram: one read, nothing to note
    big, small = rows["10.0.2.1:80"], rows["10.0.2.2:80"]
    at = {name: i for i, name in enumerate(COLUMNS)}
    assert (big[at["weight"]], big[at["capacity"]], big[at["capacity_tokens"]]) == \
        ("62", "1", "2e+04")
    assert (small[at["weight"]], small[at["capacity"]], small[at["capacity_tokens"]]) == \
        ("45", "0.5", "1e+04")
    assert big[at["normalised"]] == "memory=0.5 queue=0.25"
    assert big[at["shares"]] == "memory=0.267 queue=0.35"


def test_static_json_rows_flag_rejected_inputs() -> None:
    rows = {row["endpoint"]: row for row in json.loads(explain(STATIC, as_json=True))}
    assert set(rows) == {"10.0.2.1:80", "10.0.2.2:80", "10.0.2.3:80"}
    assert (rows["10.0.2.1:80"]["capacity"], rows["10.0.2.1:80"]["capacity_tokens"]) == \
        (1.0, 20000.0)
    assert (rows["10.0.2.2:80"]["capacity"], rows["10.0.2.2:80"]["capacity_tokens"]) == \
        (0.5, 10000.0)
    bad = rows["10.0.2.3:80"]
    assert bad["problems"] == ["kv_usage: value -0.5 rejected, outside [0, 1]",
                               "kv_usage: counted as saturated until it is valid again"]
    # reported but garbled with no good value to hold: counted as saturated (KV full)
    assert bad["inputs"]["kv_usage"] == 1.0
    assert bad["weight"] == 1 and bad["health"] == "DEGRADED"


ITL_S = 0.040


async def _growing_itl_page() -> tuple[web.AppRunner, int, list[float]]:
    """A vLLM page whose ITL histogram gains 10 tokens of ITL_S on every scrape."""
    scraped: list[float] = []

    async def metrics(_: web.Request) -> web.Response:
        scraped.append(time.monotonic())
        n, m = len(scraped) * 10, 'model_name="m"'
        return web.Response(text=(
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{m}}} 0.5\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{m}}} 0\n"
            "# TYPE vllm:inter_token_latency_seconds histogram\n"
            f'vllm:inter_token_latency_seconds_bucket{{{m},le="+Inf"}} {n}\n'
            f"vllm:inter_token_latency_seconds_count{{{m}}} {n}\n"
            f"vllm:inter_token_latency_seconds_sum{{{m}}} {n * ITL_S}\n"))

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1], scraped


def _scraped_config(port: int):
    return parse_config({
        "weights": {"policy": "composite"},
        "pools": [{"name": "v", "model": "m", "endpoints": [{"address": f"127.0.0.1:{port}"}]}],
    })


@pytest.mark.parametrize("interval", [0.2, 0.0])
def test_latency_needs_and_gets_a_second_read(interval: float) -> None:
    async def scenario() -> tuple[list, list[str], list[float]]:
        runner, port, scraped = await _growing_itl_page()
        try:
            rows, notes = await collect_rows(_scraped_config(port), sample_interval=interval)
        finally:
            await runner.cleanup()
        return rows, notes, scraped

    [row], notes, scraped = asyncio.run(scenario())
    if interval:
        assert len(scraped) == 2 and scraped[1] - scraped[0] >= interval * 0.9
        assert row["inputs"]["itl_ms"] == pytest.approx(1000 * ITL_S)
        assert row["normalised"]["latency"] == pytest.approx(ITL_S * 1000 / 50 / 2)
        assert "two reads 0.2s apart" in notes[0]
    else:
        assert len(scraped) == 1 and "itl_ms" not in row["inputs"]
        assert notes == ["latency (itl_ms) left out: the ITL histogram needs a second read"]


def test_the_weights_command_prints_json_rows(tmp_path, capsys) -> None:
    from xds_server.cli import main
    path = tmp_path / "static.yaml"
    path.write_text("telemetry: {source: static}\nweights: {policy: composite}\n"
                    "pools:\n  - name: s\n    model: m\n    endpoints:\n"
                    "      - {address: '10.0.2.1:80', signals: {kv_usage: 0.9, queue: 0}}\n"
                    "      - {address: '10.0.2.2:80', signals: {kv_usage: 0.1, queue: 0}}\n")
    assert main(["weights", "--config", str(path), "--json", "--sample-interval", "0"]) == 0
    rows = {row["endpoint"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["10.0.2.1:80"]["weight"] < rows["10.0.2.2:80"]["weight"]
