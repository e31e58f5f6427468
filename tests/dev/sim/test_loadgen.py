"""Load generator: deterministic schedules, SSE parsing, and a short run against a SimFleet."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import EXAMPLES
from trimtab_dev.loadgen import cli
from trimtab_dev.loadgen.report import distribution, percentile, summarize, sweep_report
from trimtab_dev.loadgen.runner import SseParser, run_load
from trimtab_dev.loadgen.workload import (
    WorkloadError,
    arrival_times,
    build_schedule,
    load_workload,
    parse_workload,
    request_body,
)
from trimtab_dev.sim.fleet import SimFleet

BASE: dict[str, Any] = {
    "name": "t", "seed": 5, "rate": 40, "duration_s": 0.5, "endpoint": "completions",
    "classes": [
        {"name": "short", "weight": 0.9, "prompt_tokens": {"dist": "uniform", "min": 100,
                                                           "max": 400},
         "max_tokens": {"dist": "fixed", "value": 4}},
        {"name": "long", "weight": 0.1, "prompt_tokens": {"dist": "loguniform", "min": 8192,
                                                          "max": 16000},
         "max_tokens": {"dist": "fixed", "value": 2}},
    ],
}
FLEET = {"servers": [{"name": "h", "gpu": "H100-80G", "count": 2}]}
LATENCY_KEYS = {"count", "mean", "min", "max", "p50", "p90", "p99"}


def workload(**over: Any) -> Any:
    return parse_workload({**BASE, **over})


def test_schedule_is_deterministic_for_a_seed() -> None:
    w = workload(duration_s=20)
    assert build_schedule(w) == build_schedule(w)
    assert build_schedule(w) != build_schedule(w, seed=6)
    times = [p.at for p in build_schedule(w)]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 20
    assert 800 - 3 * 29 < len(times) < 800 + 3 * 29  # Poisson(800) within 3 sigma


def test_request_attributes_do_not_depend_on_rate() -> None:
    w = workload(duration_s=10)
    slow, fast = build_schedule(w, rate=10), build_schedule(w, rate=30)
    n = min(len(slow), len(fast))
    strip = [(p.cls, p.prompt_tokens, p.max_tokens) for p in slow[:n]]
    assert strip == [(p.cls, p.prompt_tokens, p.max_tokens) for p in fast[:n]]
    assert [p.at for p in slow[:n]] != [p.at for p in fast[:n]]


def test_mixture_and_bounds() -> None:
    plan = build_schedule(workload(duration_s=50))
    long = [p for p in plan if p.cls == "long"]
    assert 0.06 < len(long) / len(plan) < 0.14
    assert all(8192 <= p.prompt_tokens <= 16000 and p.max_tokens == 2 for p in long)
    assert all(100 <= p.prompt_tokens <= 400 for p in plan if p.cls == "short")


def test_bursty_arrivals_keep_mean_and_respect_off_periods() -> None:
    import random

    w = workload(arrival={"kind": "bursty", "on_s": 1.0, "off_s": 1.0, "burst_factor": 2.0})
    times = arrival_times(w.arrival, 100.0, 200.0, random.Random(1))
    assert abs(len(times) - 20_000) < 3 * 142
    assert all(t % 2.0 < 1.0 for t in times)  # off-period rate is 0 here
    with pytest.raises(WorkloadError):
        workload(arrival={"kind": "bursty", "on_s": 1, "off_s": 1, "burst_factor": 3})


def test_bodies_carry_hint_and_capped_or_realistic_text() -> None:
    plan = [p for p in build_schedule(workload(duration_s=20)) if p.cls == "long"][0]
    small = json.loads(request_body(plan, workload()))
    assert small["prompt_tokens"] == plan.prompt_tokens and small["max_tokens"] == 2
    assert len(small["prompt"]) == 1024
    big = request_body(plan, workload(realistic_bodies=True))
    assert len(big) > 4 * plan.prompt_tokens
    chat = json.loads(request_body(plan, workload(endpoint="chat")))
    assert chat["messages"][0]["role"] == "user" and chat["stream_options"]["include_usage"]


def test_sse_parser_follows_the_spec() -> None:
    p = SseParser()
    assert p.feed(b"data: {\"a\":1}\n") == []
    assert p.feed(b"\n: comment\n\ndata:x\r\ndata: y\r\n\r\nevent: z\ndata: [DO") == [
        b'{"a":1}', b"x\ny"]
    assert p.feed(b"NE]\n\n") == [b"[DONE]"]
    assert p.feed(b"data: a\r") == []  # a CRLF split across reads
    assert p.feed(b"\n\r\n") == [b"a"]


@pytest.mark.parametrize("payload, expected", [
    (b'{"choices":[{"index":0,"text":" tok","finish_reason":null}]}', (True, None)),
    (b'{"choices":[{"delta":{"role":"assistant","content":""}}]}', (False, None)),
    (b'{"choices": [{"delta": {"content": "hi"}}]}', (True, None)),  # spaced JSON
    (b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}', (False, 7)),
])
def test_chunk_text_detection(payload: bytes, expected: tuple[bool, int | None]) -> None:
    from trimtab_dev.loadgen.runner import _event_text_and_usage

    assert _event_text_and_usage(payload) == expected


def test_percentiles_interpolate() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    d = distribution([None, 3.0, 1.0, 2.0])
    assert d["count"] == 3 and d["p50"] == 2.0 and d["max"] == 3.0
    assert distribution([])["p99"] is None


def test_run_against_sim_fleet_reports_every_field() -> None:
    w = workload()

    async def main() -> Any:
        async with SimFleet(FLEET) as fleet:
            return await run_load(list(fleet.urls.values()), w)

    result = asyncio.run(main())
    report = summarize(result)
    assert report["requests"]["sent"] == len(build_schedule(w)) > 5
    assert report["requests"]["completed"] == report["requests"]["sent"]
    assert report["errors"] == {"count": 0, "by_kind": {}}
    for key in ("ttft_s", "tpot_s", "e2e_s", "output_tokens"):
        assert report[key].keys() >= LATENCY_KEYS
    assert report["ttft_s"]["p50"] > 0 and report["e2e_s"]["p99"] >= report["ttft_s"]["p99"]
    assert report["throughput"]["req_per_s"] > 0
    assert report["throughput"]["output_tokens_per_s"] > 0
    assert set(report["per_server"]) == {"h-0", "h-1"}
    assert set(report["per_class"]) <= {"short", "long"}
    assert report["client"]["cpu_seconds"] > 0 and report["client"]["loop_lag_p99_ms"] >= 0
    by_cls = {r.cls: r.output_tokens for r in result.records}
    assert by_cls.get("short", 4) == 4 and by_cls.get("long", 2) == 2


def test_errors_are_counted_by_kind() -> None:
    w = workload(duration_s=0.3)

    async def main() -> Any:
        async with SimFleet({"servers": [{"name": "d", "gpu": "L4-24G",
                                          "faults": {"dead": True}}]}) as fleet:
            return await run_load([fleet.urls["d"]], w)

    report = summarize(asyncio.run(main()))
    assert report["requests"]["completed"] == 0
    assert report["errors"]["by_kind"] == {"connect": report["requests"]["sent"]}
    assert report["ttft_s"]["p50"] is None


def test_cli_single_run_and_sweep(tmp_path: Path) -> None:
    spec = tmp_path / "w.yaml"
    spec.write_text(json.dumps({**BASE, "duration_s": 0.3}))
    out, sweep_out, records = tmp_path / "o.json", tmp_path / "s.json", tmp_path / "r.jsonl"

    async def main() -> tuple[int, int]:
        async with SimFleet(FLEET) as fleet:
            target = fleet.urls["h-0"]
            args = ["--target", target, "--workload", str(spec), "--quiet"]
            one = await asyncio.to_thread(cli.main, [*args, "--out", str(out),
                                                     "--records", str(records)])
            two = await asyncio.to_thread(cli.main, [*args, "--out", str(sweep_out),
                                                     "--sweep", "10,30"])
            return one, two

    assert asyncio.run(main()) == (0, 0)
    report = json.loads(out.read_text())
    assert report["workload"]["seed"] == 5 and report["requests"]["errors"] == 0
    lines = records.read_text().splitlines()
    assert len(lines) == report["requests"]["sent"]
    assert {"ttft", "tpot", "e2e", "output_tokens", "error", "status"} <= json.loads(lines[0]).keys()
    sweep = json.loads(sweep_out.read_text())
    assert [row["offered_rate"] for row in sweep["rows"]] == [10.0, 30.0]
    assert all("decay_from_peak" in row for row in sweep["rows"])


def test_cli_rejects_bad_workload(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rate: -1\n")
    assert cli.main(["--target", "http://127.0.0.1:1", "--workload", str(bad)]) == 2


def test_sweep_report_finds_peak() -> None:
    def fake(rate: float, tps: float) -> dict[str, Any]:
        return {"offered_rate": rate, "throughput": {"req_per_s": rate, "output_tokens_per_s": tps},
                "errors": {"count": 0}, "ttft_s": {"p99": 0.1}, "e2e_s": {"p99": 1.0}}

    out = sweep_report([fake(1, 100), fake(2, 200), fake(4, 150)])
    assert out["peak"] == {"offered_rate": 2, "output_tokens_per_s": 200}
    assert out["rows"][2]["decay_from_peak"] == pytest.approx(0.25)


def test_example_workload_loads() -> None:
    root = EXAMPLES
    w = load_workload(root / "workload-mixed.yaml")
    long = next(c for c in w.classes if c.name == "long-context")
    total = sum(c.weight for c in w.classes)
    assert 0.05 <= long.weight / total <= 0.10
    assert long.prompt_tokens.min == 8192 and (long.prompt_tokens.max or 0) <= 32_000


def _virtual_in_flight(fleet_path: Path, w: Any, until: float, since: float) -> float:
    """Mean requests in flight over ``[since, until]`` when ``w``'s schedule goes to the
    fleet's engines in virtual time through Envoy's least_request with equal weights (two
    random choices, the one with fewer active requests)."""
    import heapq
    import random

    from trimtab_dev.sim.engine import Engine, ManualClock, SimRequest
    from trimtab_dev.sim.fleet import expand, load_fleet

    clock, pick = ManualClock(), random.Random(1)
    engines = [Engine(c.gpu, c.model, c.efficiency, clock=clock, max_model_len=c.max_model_len)
               for c in expand(load_fleet(fleet_path))]
    active, stepping = [0] * len(engines), [None] * len(engines)
    events: list[tuple[float, int, int, Any]] = [
        (p.at, 0, p.index, (p.prompt_tokens, p.max_tokens))
        for p in build_schedule(w, rate=w.rate, duration=until, seed=w.seed)]
    heapq.heapify(events)
    area, last, seq = 0.0, 0.0, len(events)
    while events:
        t, kind, _, what = heapq.heappop(events)
        area += sum(active) * max(0.0, min(t, until) - max(last, since))
        last = t
        clock.set(t)
        if kind == 0:
            a, b = pick.sample(range(len(engines)), 2)
            k = a if active[a] <= active[b] else b
            engines[k].submit(SimRequest(f"r{seq}", *what), now=t)
            active[k] += 1
        else:
            k = what
            active[k] -= len(engines[k].finish_step(stepping[k]).finished)
            stepping[k] = None
        if stepping[k] is None and (plan := engines[k].plan_step(now=t)) is not None:
            stepping[k], seq = plan, seq + 1
            heapq.heappush(events, (t + plan.duration, 1, seq, k))
    return area / (until - since)


def test_the_selfcheck_workload_holds_about_200_streams_on_the_hetero_fleet() -> None:
    root = EXAMPLES
    w = load_workload(root / "workload-selfcheck.yaml")
    mean = _virtual_in_flight(root / "fleet-hetero.yaml", w, until=70.0, since=30.0)
    assert 160 <= mean <= 240, mean
