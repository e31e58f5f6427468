"""Tests for the model-server page adapters and windowed histogram means."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.paths import METRICS_FIXTURES
from xds_server.telemetry.histories import HistogramHistory, windowed_mean
from xds_server.telemetry.parsers import detect_server, page_signals, parse_page
from xds_server.telemetry.parsers.reader import MetricsFormatError
from xds_server.telemetry.reading import (
    HistogramState,
    PageReading,
    histogram_from_signals,
    screen_signals,
)

FIXTURES = METRICS_FIXTURES
MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'


def page(name: str) -> str:
    return (FIXTURES / name).read_text()


def without(text: str, *fragments: str) -> str:
    kept = [line for line in text.splitlines() if not any(f in line for f in fragments)]
    return "\n".join(kept) + "\n"


def gauge(name: str, value: str, labels: str = MODEL) -> str:
    return f"# TYPE {name} gauge\n{name}{{{labels}}} {value}\n"


# --- each server type from a real-format fixture --------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "vllm_v1.txt",
            dict(server="vllm", queue=4.0, running=12.0, kv_usage=0.4375),
        ),
        (
            "vllm_v0_deprecated.txt",
            dict(server="vllm", queue=6.0, running=21.0, kv_usage=0.8125),
        ),
        ("sglang.txt", dict(server="sglang", queue=2.0, running=7.0, kv_usage=0.28)),
        ("tgi.txt", dict(server="tgi", queue=3.0, running=6.0, kv_usage=None)),
        ("trtllm_triton.txt", dict(server="trtllm", queue=3.0, running=8.0, kv_usage=0.25)),
        ("trtllm_serve.txt", dict(server="trtllm", queue=4.0, running=9.0, kv_usage=0.62)),
        (
            "dcgm_multi_gpu.txt",
            dict(server="dcgm", queue=None, running=None, gpu_mem_pct=75.0, gpu_util_pct=99.0),
        ),
    ],
)
def test_fixture_pages_normalise(fixture: str, expected: dict[str, object]) -> None:
    reading = parse_page(page(fixture))
    for name, value in expected.items():
        assert getattr(reading, name) == value, name
    assert reading.problems == ()


def test_vllm_current_names_capacity_and_histograms() -> None:
    reading = parse_page(page("vllm_v1.txt"))
    assert reading.kv_capacity_tokens == 27335 * 16
    # inter_token_latency wins over the deprecated time_per_output_token on the same page.
    assert reading.histograms == {
        "itl": HistogramState(sum=1248.0, count=52000.0),
        "ttft": HistogramState(sum=162.0, count=1200.0),
    }
    assert not reading.has_dcgm


def test_vllm_deprecated_names_are_used_as_fallback() -> None:
    reading = parse_page(page("vllm_v0_deprecated.txt"))
    assert reading.histograms["itl"] == HistogramState(sum=240.0, count=8000.0)
    assert reading.kv_capacity_tokens == 5691 * 16


def test_vllm_prefers_kv_cache_usage_over_deprecated_gauge() -> None:
    text = page("vllm_v1.txt") + gauge("vllm:gpu_cache_usage_perc", "0.99")
    assert parse_page(text).kv_usage == 0.4375


def test_vllm_data_parallel_series_are_combined() -> None:
    reading = parse_page(page("vllm_data_parallel.txt"))
    assert (reading.queue, reading.running, reading.kv_usage) == (8.0, 24.0, 0.75)
    assert reading.kv_capacity_tokens == 2 * 20000 * 16
    assert reading.histograms["itl"] == HistogramState(sum=110.0, count=4000.0)


def test_sglang_histograms() -> None:
    reading = parse_page(page("sglang.txt"))
    assert reading.histograms["itl"] == HistogramState(sum=1620.0, count=90000.0)
    assert reading.histograms["ttft"] == HistogramState(sum=540.0, count=2400.0)


def test_tgi_per_token_time_as_histogram_or_gauge() -> None:
    hist = parse_page(page("tgi.txt"))
    assert hist.histograms == {"itl": HistogramState(sum=12.27, count=409.0)}
    assert hist.itl_ms is None
    text = without(page("tgi.txt"), "tgi_request_mean_time_per_token_duration")
    as_gauge = parse_page(text + gauge("tgi_request_mean_time_per_token_duration", "0.031", ""))
    assert as_gauge.itl_ms == pytest.approx(31.0)
    assert "itl" not in as_gauge.histograms


def test_trtllm_triton_capacity_and_block_fallbacks() -> None:
    text = page("trtllm_triton.txt")
    assert parse_page(text).kv_capacity_tokens == 6239 * 64
    no_fraction = without(text, 'kv_cache_block_type="fraction"')
    assert parse_page(no_fraction).kv_usage == pytest.approx(1560 / 6239)
    used_free_only = without(no_fraction, 'kv_cache_block_type="max"')
    assert parse_page(used_free_only).kv_usage == pytest.approx(1560 / (1560 + 4679))
    assert parse_page(used_free_only).kv_capacity_tokens is None


def test_trtllm_running_falls_back_to_active() -> None:
    text = without(page("trtllm_triton.txt"), 'request_type="scheduled"')
    assert parse_page(text).running == 11.0


def test_trtllm_used_above_max_is_rejected() -> None:
    text = without(page("trtllm_triton.txt"), 'kv_cache_block_type="fraction"')
    text = text.replace(
        'kv_cache_block_type="used",model="tensorrt_llm",version="1"} 1560.0',
        'kv_cache_block_type="used",model="tensorrt_llm",version="1"} 9999.0',
    )
    reading = parse_page(text)
    assert reading.kv_usage is None
    assert any("used/total" in p for p in reading.problems)


def test_detect_server() -> None:
    assert detect_server(["vllm:num_requests_waiting", "DCGM_FI_DEV_FB_USED"]) == "vllm"
    assert detect_server(["nv_trt_llm_request_metrics"]) == "trtllm"
    assert detect_server(["trtllm:num_requests_waiting"]) == "trtllm"
    assert detect_server(["DCGM_FI_DEV_GPU_UTIL"]) == "dcgm"
    assert detect_server(["python_info"]) is None


# --- DCGM on the same page ------------------------------------------------------------------


def test_vllm_page_with_dcgm_reads_the_busiest_gpu() -> None:
    reading = parse_page(page("vllm_with_dcgm.txt"))
    assert reading.server == "vllm" and reading.has_dcgm
    assert reading.gpu_mem_pct == pytest.approx(100.0 * 70000 / 81559)  # of the page's two GPUs


@pytest.mark.parametrize(
    ("gpu", "uuid", "mem", "util"),
    [
        ("2", None, 40.0, 54.0),
        (None, "GPU-3a1b2c3d-3333-4333-8333-333333333333", 5.0, 3.0),
        ("1", "GPU-1a1b2c3d-1111-4111-8111-111111111111", 75.0, 99.0),
        (None, None, 75.0, 99.0),
    ],
)
def test_dcgm_gpu_selection(gpu: str | None, uuid: str | None, mem: float, util: float) -> None:
    reading = parse_page(page("dcgm_multi_gpu.txt"), gpu=gpu, uuid=uuid)
    assert (reading.gpu_mem_pct, reading.gpu_util_pct) == (mem, util)


def test_dcgm_unknown_gpu_is_a_problem_not_a_guess() -> None:
    reading = parse_page(page("vllm_with_dcgm.txt"), gpu="7")
    assert reading.gpu_mem_pct is None
    assert any("gpu='7'" in p for p in reading.problems)
    assert reading.queue == 3.0  # the model-server signals survive
    with pytest.raises(MetricsFormatError, match="no usable signal"):
        parse_page(page("dcgm_multi_gpu.txt"), gpu="0", uuid="GPU-not-this-one")


def test_dcgm_unpaired_and_nan_are_rejected() -> None:
    unpaired = parse_page(without(page("vllm_with_dcgm.txt"), 'FB_FREE{gpu="1"'))
    assert unpaired.gpu_mem_pct is None
    assert any("not paired" in p for p in unpaired.problems)
    nan = parse_page(page("vllm_with_dcgm.txt").replace("} 70000", "} NaN"))
    assert nan.gpu_mem_pct is None and any("nan" in p for p in nan.problems)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metric", "value", "signal"),
    [
        ("vllm:kv_cache_usage_perc", "NaN", "kv_usage"),
        ("vllm:kv_cache_usage_perc", "1.5", "kv_usage"),
        ("vllm:kv_cache_usage_perc", "-0.1", "kv_usage"),
        ("vllm:num_requests_waiting", "-1", "queue"),
        ("vllm:num_requests_waiting", "+Inf", "queue"),
        ("vllm:num_requests_running", "NaN", "running"),
    ],
)
def test_invalid_value_drops_only_that_signal(metric: str, value: str, signal: str) -> None:
    text = without(page("vllm_v1.txt"), f"{metric}{{") + gauge(metric, value, 'engine="0"')
    reading = parse_page(text)
    assert getattr(reading, signal) is None
    assert [p for p in reading.problems if p.startswith(f"{signal}:")]
    others = {"queue", "running", "kv_usage"} - {signal}
    assert all(getattr(reading, name) is not None for name in others)


def test_one_bad_series_among_many_drops_the_signal() -> None:
    text = page("vllm_data_parallel.txt").replace(
        'vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0',
        'vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} NaN',
    )
    reading = parse_page(text)
    assert reading.queue is None and reading.running == 24.0


def test_unprofiled_cache_config_is_a_problem() -> None:
    text = page("vllm_v1.txt").replace('num_gpu_blocks="27335"', 'num_gpu_blocks="None"')
    reading = parse_page(text)
    assert reading.kv_capacity_tokens is None
    assert any(p.startswith("kv_capacity_tokens:") for p in reading.problems)


def test_negative_histogram_sum_is_rejected() -> None:
    text = page("vllm_v1.txt").replace(
        f'vllm:inter_token_latency_seconds_sum{{engine="0",{MODEL}}} 1248.0',
        f'vllm:inter_token_latency_seconds_sum{{engine="0",{MODEL}}} -3.0',
    )
    reading = parse_page(text)
    assert "itl" not in reading.histograms and "ttft" in reading.histograms
    assert any(p.startswith("itl:") for p in reading.problems)


def test_screen_keeps_valid_signals_and_describes_the_rest() -> None:
    signals = {
        "queue": 3, "running": 0.0, "kv_usage": 1.0, "gpu_mem_pct": 100.0, "itl_ms": 12.5,
        "kv_capacity_tokens": 16.0, "itl_sum": 2.0, "itl_count": 9.0, "fb_used_mib": -1.0,
    }
    bad = {"kv_usage": math.nan, "queue": -1.0, "gpu_mem_pct": 100.5, "itl_ms": math.inf,
           "kv_capacity_tokens": 0.0, "itl_count": -2.0, "running": True, "gpu_util_pct": "7"}
    clean, problems = screen_signals(signals)
    assert clean == {k: float(v) for k, v in signals.items()} and problems == ()
    clean, problems = screen_signals({**signals, **bad})
    assert clean.keys() == signals.keys() - bad.keys()
    assert sorted(p.split(":")[0] for p in problems) == sorted(bad)
    assert "kv_usage: value nan rejected, outside [0, 1]" in problems


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (page("garbage.txt"), "not a Prometheus text page"),
        ("", "no recognised"),
        ("# TYPE python_info gauge\npython_info 1\n", "no recognised"),
        (gauge("vllm:kv_cache_usage_perc", "NaN"), "kv_usage: vllm:kv_cache_usage_perc is nan"),
        ("# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total 5\n", "no known signal"),
    ],
)
def test_unusable_pages_raise(text: str, message: str) -> None:
    with pytest.raises(MetricsFormatError, match=message):
        parse_page(text)


# --- flat signals for the telemetry store ---------------------------------------------------


def test_signals_view_round_trips_histograms() -> None:
    reading = parse_page(page("vllm_v1.txt"))
    signals = reading.signals()
    assert signals["queue"] == 4.0 and signals["kv_capacity_tokens"] == 437360.0
    assert "gpu_mem_pct" not in signals
    assert histogram_from_signals(signals, "itl") == reading.histograms["itl"]
    assert histogram_from_signals(signals, "nope") is None
    assert page_signals(page("vllm_v1.txt")) == signals


def test_page_reading_is_frozen() -> None:
    reading = PageReading(server="vllm", queue=1.0)
    with pytest.raises(AttributeError):
        reading.queue = 2.0  # type: ignore[misc]


# --- windowed_mean --------------------------------------------------------------------------


def test_windowed_mean_of_two_successive_scrapes() -> None:
    first = parse_page(page("vllm_scrape_1.txt")).histograms["itl"]
    second = parse_page(page("vllm_scrape_2.txt")).histograms["itl"]
    history = [(100.0, first), (105.0, second)]
    assert windowed_mean(history, now=105.0, window_s=30.0) == pytest.approx(18.0 / 600.0)


def test_windowed_mean_ignores_samples_outside_the_window() -> None:
    history = [
        (0.0, HistogramState(0.0, 0.0)),
        (50.0, HistogramState(10.0, 100.0)),
        (55.0, HistogramState(40.0, 200.0)),
    ]
    assert windowed_mean(history, now=60.0, window_s=15.0) == pytest.approx(0.3)
    assert windowed_mean(history, now=60.0, window_s=100.0) == pytest.approx(0.2)
    assert windowed_mean(list(reversed(history)), now=60.0, window_s=15.0) == pytest.approx(0.3)


def test_windowed_mean_counter_reset_uses_newest_alone() -> None:
    history = [
        (0.0, HistogramState(500.0, 10000.0)),
        (5.0, HistogramState(0.4, 10.0)),
        (10.0, HistogramState(1.2, 30.0)),
    ]
    assert windowed_mean(history, now=10.0, window_s=60.0) == pytest.approx(0.04)


@pytest.mark.parametrize(
    "history",
    [
        [],
        [(10.0, HistogramState(1.0, 10.0))],
        [(5.0, HistogramState(1.0, 10.0)), (10.0, HistogramState(1.0, 10.0))],
        [(5.0, HistogramState(5.0, 10.0)), (10.0, HistogramState(0.0, 0.0))],
        [(99.0, HistogramState(1.0, 10.0)), (100.0, HistogramState(2.0, 20.0))],  # future
    ],
)
def test_windowed_mean_none_without_new_observations(
    history: list[tuple[float, HistogramState]],
) -> None:
    assert windowed_mean(history, now=10.0, window_s=60.0) is None


@given(
    mean=st.floats(min_value=1e-4, max_value=10.0),
    steps=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=20),
)
def test_windowed_mean_recovers_a_constant_mean(mean: float, steps: list[int]) -> None:
    history, total, count = [(0.0, HistogramState(0.0, 0.0))], 0.0, 0.0
    for i, n in enumerate(steps, start=1):
        count += n
        total += n * mean
        history.append((float(i), HistogramState(total, count)))
    result = windowed_mean(history, now=float(len(steps)), window_s=1e9)
    if count == 0:
        assert result is None
    else:
        assert result is not None and math.isclose(result, mean, rel_tol=1e-9)


def test_histogram_history_keeps_a_bounded_window() -> None:
    history = HistogramHistory(window_s=10.0, max_samples=3)
    for t in range(5):  # only the last 3 states are kept: t=2, 3, 4
        history.record(("a", "itl"), float(t), HistogramState(sum=t * t, count=t * 10.0))
    assert history.mean(("a", "itl"), now=4.0) == pytest.approx((16 - 4) / 20)
    assert history.mean(("b", "itl"), now=4.0) is None
    history.forget(lambda key: key != ("a", "itl"))
    assert history.mean(("a", "itl"), now=4.0) is None
    with pytest.raises(ValueError):
        HistogramHistory(window_s=0.0)


def test_vllm_work_counters_are_read_for_the_queueing_policy() -> None:
    text = (gauge("vllm:num_requests_waiting", "2")
            + "# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{engine=\"0\"} 1200\n"
            + "vllm:prompt_tokens_total{engine=\"1\"} 300\n"
            + "# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total 450\n"
            + "# TYPE vllm:request_success counter\n"
            + "vllm:request_success_total{finished_reason=\"length\"} 3\n"
            + "vllm:request_success_total{finished_reason=\"stop\"} 4\n")
    signals = parse_page(text).signals()
    assert signals["prompt_tokens"] == 1500.0  # summed over series
    assert signals["generation_tokens"] == 450.0
    assert signals["requests_done"] == 7.0  # every finished_reason
    assert signals["queue"] == 2.0
