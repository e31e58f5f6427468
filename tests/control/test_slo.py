"""SLO telemetry: histogram quantiles, page parsing, per-version windows."""

from __future__ import annotations

import math

import pytest

from xds_server.config.pools import GateConfig
from xds_server.control.rollouts.machine import gate_breach
from xds_server.control.slo import SloTracker, quantile
from xds_server.telemetry.parsers import parse_page
from xds_server.telemetry.reading import SloCounters


def vllm_page(ttft: dict[str, int], finished: int, errors: int = 0) -> str:
    lines = ["# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
             "# TYPE vllm:time_to_first_token_seconds histogram"]
    for le, count in ttft.items():
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {count}')
    total = max(ttft.values())
    lines += [f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {total}',
              f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {total * 0.1}',
              "# TYPE vllm:e2e_request_latency_seconds histogram",
              f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="m"}} {finished}',
              f'vllm:e2e_request_latency_seconds_count{{model_name="m"}} {finished}',
              f'vllm:e2e_request_latency_seconds_sum{{model_name="m"}} {finished * 2.0}',
              "# TYPE http_requests_total counter",
              f'http_requests_total{{handler="/v1/completions",method="POST",status="2xx"}} {finished}',
              f'http_requests_total{{handler="/v1/completions",method="POST",status="5xx"}} {errors}',
              "# TYPE vllm:num_requests_waiting gauge",
              'vllm:num_requests_waiting{model_name="m"} 3']
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_like_promql():
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.95, buckets) == pytest.approx(0.75)
    assert quantile(0.95, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {1.0: 10.0, math.inf: 20.0}) == 1.0  # beyond the last finite bound


def parse_slo(text: str) -> SloCounters | None:
    return parse_page(text, with_slo=True).slo


def test_one_parse_reads_the_weight_signals_and_the_slo_counters():
    reading = parse_page(vllm_page({"0.1": 5, "0.5": 9, "+Inf": 10}, finished=10, errors=2),
                         with_slo=True)
    assert reading.queue == 3.0 and reading.slo is not None
    assert reading.slo.ttft == {0.1: 5.0, 0.5: 9.0, math.inf: 10.0} and reading.slo.itl == {}
    assert (reading.slo.requests, reading.slo.errors) == (10.0, 2.0)
    assert "slo" not in "".join(reading.signals())  # never smuggled in among the signals


def test_slo_counters_are_read_only_when_asked_and_only_where_present():
    text = vllm_page({"0.1": 5, "+Inf": 10}, finished=10)
    assert parse_page(text).slo is None
    assert parse_slo('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 1\n') is None


def test_the_newer_itl_histogram_wins_over_the_deprecated_one():
    old = "vllm:time_per_output_token_seconds_bucket"
    new = "vllm:inter_token_latency_seconds_bucket"
    text = (f'{old}{{le="0.1"}} 7\n{old}{{le="+Inf"}} 7\n{new}{{le="0.1"}} 2\n'
            f'{new}{{le="+Inf"}} 3\nvllm:num_requests_waiting 0\n')
    slo = parse_slo(text)
    assert slo is not None and slo.itl == {0.1: 2.0, math.inf: 3.0}


def test_bucket_sums_that_are_not_counts_are_left_out():
    name = "vllm:time_to_first_token_seconds_bucket"
    slo = parse_slo(f'{name}{{le="0.1"}} -1\n{name}{{le="+Inf"}} NaN\n{name}{{le="1"}} 4\n'
                    'vllm:num_requests_waiting 0\n')
    assert slo is not None and slo.ttft == {1.0: 4.0}


def test_tracker_window_deltas_per_version_and_restart():
    t = SloTracker()
    t.record("a", 0.0, parse_slo(vllm_page({"0.1": 100, "1": 100, "+Inf": 100}, 100)))
    t.record("a", 10.0, parse_slo(vllm_page({"0.1": 100, "1": 200, "+Inf": 200}, 200, 10)))
    t.record("b", 0.0, parse_slo(vllm_page({"0.1": 0, "1": 0, "+Inf": 0}, 0)))
    t.record("b", 10.0, parse_slo(vllm_page({"0.1": 100, "1": 100, "+Inf": 100}, 100)))
    slow = t.stats(["a"], since=0.0)
    assert slow.requests == 110 and slow.errors == 10  # 100 finished + 10 failed
    assert 0.9 < (slow.ttft_p95_s or 0) <= 1.0  # the window's requests all took 0.1-1 s
    both = t.stats(["a", "b"], since=0.0)
    assert both.requests == 210 and (both.ttft_p95_s or 0) < (slow.ttft_p95_s or 0)
    t.record("b", 20.0, parse_slo(vllm_page({"0.1": 5, "1": 5, "+Inf": 5}, 5)))  # restarted
    assert t.stats(["b"], since=10.0).requests == 5


def test_a_version_failing_every_request_is_judged_on_its_errors():
    t = SloTracker()
    empty = {"0.1": 0, "+Inf": 0}
    for address in ("stable", "canary"):
        t.record(address, 0.0, parse_slo(vllm_page(empty, finished=0)))
    t.record("stable", 5.0, parse_slo(vllm_page({"0.1": 40, "+Inf": 40}, finished=40)))
    t.record("canary", 5.0, parse_slo(vllm_page(empty, finished=0, errors=30)))
    stable, canary = t.stats(["stable"], since=0.0), t.stats(["canary"], since=0.0)
    assert (canary.requests, canary.errors, canary.error_rate) == (30, 30, 1.0)
    assert (stable.requests, stable.error_rate) == (40, 0.0)
    breach = gate_breach(stable, canary, GateConfig(min_requests=20, error_rate_tolerance=0.05))
    assert breach is not None and "error rate canary 100.00%" in breach
