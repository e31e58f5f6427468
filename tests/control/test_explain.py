"""`trimtab weights`: the explanation table and JSON rows, from static and scraped telemetry."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.control.explain import collect_rows, explain, explain_rows, render_table
from xds_server.xds.cache import SnapshotCache

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
COMPOSITE_COLUMNS = ["endpoint", "locality", "weight", "health", "capacity", "kv cap",
                     "normalised", "headroom", "reason"]
QUEUEING_COLUMNS = ["endpoint", "locality", "weight", "health", "kv", "queue", "run", "tok/s",
                    "wait s", "kv cap", "reason"]


def _sections(text: str) -> tuple[dict[str, tuple[str, list[str], dict[str, list[str]]]],
                                  list[str]]:
    """({cluster heading: (heading, header, endpoint -> cells)}, notes); cells are split on
    runs of 2+ spaces and a reason wrapped onto continuation lines is joined again."""
    sections: dict[str, tuple[str, list[str], dict[str, list[str]]]] = {}
    notes: list[str] = []
    rows: dict[str, list[str]] = {}
    last: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("note: "):
            notes.append(line[len("note: "):])
            last = None
        elif line.startswith("      ") and notes and last is None:
            notes[-1] += " " + line.strip()
        elif line.startswith("pool "):
            rows = {}
            sections[line] = (line, [], rows)
        elif line.startswith(" ") and last is not None:
            _, header, _ = sections[list(sections)[-1]]
            if len(last) < len(header):  # the reason on lines of its own under the row
                last.append(line.strip())
            else:
                last[-1] += " " + line.strip()
        elif line.strip():
            cells = [c.strip() for c in line.split("  ") if c.strip()]
            _, header, _ = sections[list(sections)[-1]]
            if not header:
                header.extend(cells)
            else:
                rows[cells[0]] = last = cells
    return sections, notes


def _table(text: str) -> tuple[list[str], dict[str, list[str]], list[str]]:
    """(header, endpoint -> cells, notes) of a one-cluster table."""
    sections, notes = _sections(text)
    [(_, header, rows)] = sections.values()
    return header, rows, notes


def test_static_table_shows_relative_and_token_capacity_side_by_side() -> None:
    text = explain(STATIC)
    assert text.splitlines()[0] == "pool s: policy composite, lb least_request"
    header, rows, notes = _table(text)
    assert header == COMPOSITE_COLUMNS and notes == []  # no ITL histogram: nothing to note
    big, small = rows["10.0.2.1:80"], rows["10.0.2.2:80"]
    at = {name: i for i, name in enumerate(COMPOSITE_COLUMNS)}
    assert (big[at["weight"]], big[at["capacity"]], big[at["kv cap"]]) == ("62", "1", "20k")
    assert (small[at["weight"]], small[at["capacity"]], small[at["kv cap"]]) == \
        ("45", "0.5", "10k")
    assert big[at["normalised"]] == "mem=0.5 q=0.25"
    assert big[at["headroom"]] == "0.617"
    # a long reason wraps in its column and reads whole again
    assert rows["10.0.2.3:80"][at["reason"]].startswith("degraded: kv_usage 1 >= 0.95; input")
    assert rows["10.0.2.3:80"][at["reason"]].endswith("counted as saturated until it is "
                                                      "valid again")


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


# -- `trimtab weights` fits 120 columns -----------------------------------------------------------

def _realistic_controller() -> Controller:
    """The default policy (queueing, capacity tiers as localities) on a heterogeneous fleet
    after a few ticks of vLLM pages (the golden recording's): H100/A100/L4-sized KV caches,
    queues, measured service rates; a long pool name, IPv6 endpoints and a canary pool."""
    from tests.test_golden_xds import INTERVAL, START, PageScraper, fleet_pages

    config = parse_config({"pools": [
        {"name": "llama3-70b-instruct-prod", "model": "meta-llama/Llama-3.1-70B-Instruct",
         "long_context": "auto",
         "endpoints": [{"address": f"10.100.{i}.{j}:8000"} for i in range(3) for j in range(1, 4)]
         + [{"address": "[2001:db8:ffff:1234::a1]:8000"}]},
        {"name": "qwen", "model": "qwen", "lb_policy": "round_robin",
         "versions": {"stable": {"endpoints": [{"address": "10.2.0.1:8000"},
                                               {"address": "10.2.0.2:8000"}]},
                      "canary": {"endpoints": [{"address": "10.2.1.1:8000"}]}},
         "rollout": {"start_percent": 10}},
    ]})
    clock = [START]
    pages: list[dict[str, str]] = [{}]
    scraper = PageScraper(lambda: pages[0])
    controller = Controller(config, SnapshotCache(), scraper=scraper, clock=lambda: clock[0])

    async def ticks() -> None:
        try:
            for tick in range(6):
                pages[0] = fleet_pages(config, tick)
                await controller.tick()
                clock[0] += INTERVAL
        finally:
            await controller.close()
            await scraper.close()

    asyncio.run(ticks())
    return controller


def test_the_table_fits_120_columns_and_keeps_the_columns_the_policy_weighs_by() -> None:
    rows = explain_rows(_realistic_controller())
    note = ("latency (itl_ms) is the mean ITL between two reads 1s apart; an endpoint that "
            "produced no tokens in between shows none")
    text = render_table(rows, [note])
    too_wide = [line for line in text.splitlines() if len(line) > 120]
    assert too_wide == []
    sections, notes = _sections(text)
    assert notes == [note]  # wrapped, not cut
    assert list(sections) == [
        "pool llama3-70b-instruct-prod: policy queueing, lb least_request",
        "pool qwen: policy queueing, lb round_robin",
        "pool qwen, cluster qwen-canary: policy queueing, lb round_robin"]
    big = sections[list(sections)[0]]
    assert big[1] == QUEUEING_COLUMNS  # no composite-only or per-pool repeated columns
    assert set(big[2]) == {row["endpoint"] for row in rows
                           if row["cluster"] == "llama3-70b-instruct-prod"}
    at = {name: i for i, name in enumerate(QUEUEING_COLUMNS)}
    by_row = {row["endpoint"]: row for row in rows}
    for endpoint, cells in big[2].items():
        row = by_row[endpoint]
        assert len(cells) == len(QUEUEING_COLUMNS), cells
        assert cells[at["weight"]] == str(row["weight"])
        assert cells[at["health"]] == row["health"]
        assert cells[at["locality"]] == row["locality"]  # the capacity tier and its weight
        assert cells[at["reason"]] == row["reason"]  # wrapped in its column, never cut
    # the tiers show, and so do the estimates the queueing policy weighs by
    assert len({cells[at["locality"]] for cells in big[2].values()}) >= 3
    assert all(cells[at["tok/s"]] != "-" and cells[at["wait s"]] != "-"
               for cells in big[2].values())
    assert any(row["service_rate"] > 1000 for row in rows)  # shown as 2.7k, not 2.7e+03
    assert not any("e+" in line for line in text.splitlines())


def test_a_narrow_table_puts_the_reason_under_the_row_rather_than_overflowing() -> None:
    rows = [{"pool": "p", "cluster": "p", "endpoint": "10.0.0.1:80", "policy": "gpu_memory",
             "lb_policy": "round_robin", "locality": None, "weight": 50, "health": "HEALTHY",
             "stale": True, "inputs": {"gpu_mem_pct": 99.0},
             "reason": "fail-static: " + "every read failed " * 10}]
    text = render_table(rows, width=70)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 70
    assert lines[1].split() == ["endpoint", "locality", "weight", "health", "gpu", "mem", "%",
                                "reason"]
    assert lines[2].split() == ["10.0.0.1:80", "-", "50", "HEALTHY", "stale", "99"]
    assert lines[3].startswith("    fail-static: every read failed")
    [(_, _, parsed)] = _sections(text)[0].values()
    assert parsed["10.0.0.1:80"][-1] == rows[0]["reason"].strip()


def test_a_stale_endpoint_says_stale_once() -> None:
    base = {"pool": "p", "cluster": "p", "policy": "queueing", "lb_policy": "least_request",
            "locality": None, "weight": 1, "stale": True, "inputs": {}, "reason": "r"}
    rows = [{**base, "endpoint": "10.0.0.1:80", "health": "STALE"},
            {**base, "endpoint": "10.0.0.2:80", "health": "HEALTHY"}]
    [(_, _, parsed)] = _sections(render_table(rows))[0].values()
    assert parsed["10.0.0.1:80"][3] == "STALE" and parsed["10.0.0.2:80"][3] == "HEALTHY stale"
