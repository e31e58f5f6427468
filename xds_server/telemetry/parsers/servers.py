"""Per-server extractors: vLLM, SGLang, TGI and TensorRT-LLM metric names -> signals."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from xds_server.telemetry.parsers.reader import Reader, fsum, prefixed
from xds_server.telemetry.reading import HistogramState, valid

_TRT_REQUESTS = "nv_trt_llm_request_metrics"
_TRT_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
_TRT = ("trtllm_", "trtllm:")


Fields = dict[str, float | None]
Extracted = tuple[Fields, dict[str, HistogramState]]


def _histograms(r: Reader, itl: Sequence[str], ttft: Sequence[str]) -> dict[str, HistogramState]:
    found = {"itl": r.histogram("itl", itl), "ttft": r.histogram("ttft", ttft)}
    return {key: state for key, state in found.items() if state is not None}


def _vllm_capacity(r: Reader) -> float | None:
    """Sum over ``vllm:cache_config_info`` series of ``num_gpu_blocks * block_size``."""
    rows = r.index.get("vllm:cache_config_info", [])
    if not rows:
        return None
    total = 0.0
    for labels, _ in rows:
        try:
            tokens = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
        except (KeyError, ValueError):
            blocks, size = labels.get("num_gpu_blocks"), labels.get("block_size")
            r.reject("kv_capacity_tokens", "vllm:cache_config_info", f"{blocks=} {size=}")
            return None
        if not valid(tokens, 1.0, math.inf):
            r.reject("kv_capacity_tokens", "vllm:cache_config_info", f"gives {tokens!r} tokens")
            return None
        total += tokens
    return total


def _vllm(r: Reader) -> Extracted:
    fields: Fields = {
        "queue": r.gauge("queue", ["vllm:num_requests_waiting"], fsum),
        "running": r.gauge("running", ["vllm:num_requests_running"], fsum),
        "kv_usage": r.gauge(
            "kv_usage", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"], max, (0, 1)
        ),
        "kv_capacity_tokens": _vllm_capacity(r),
        # counters: the parser names a counter's sample ``<name>_total``
        "requests_done": r.gauge("requests_done", ["vllm:request_success_total"], fsum),
        "prompt_tokens": r.gauge("prompt_tokens", ["vllm:prompt_tokens_total"], fsum),
        "generation_tokens": r.gauge("generation_tokens", ["vllm:generation_tokens_total"],
                                     fsum),
    }
    itl = ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"]
    return fields, _histograms(r, itl, ["vllm:time_to_first_token_seconds"])


def _sglang(r: Reader) -> Extracted:
    fields: Fields = {
        "queue": r.gauge("queue", ["sglang:num_queue_reqs"], fsum),
        "running": r.gauge("running", ["sglang:num_running_reqs"], fsum),
        "kv_usage": r.gauge("kv_usage", ["sglang:token_usage"], max, (0, 1)),
    }
    itl = ["sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"]
    return fields, _histograms(r, itl, ["sglang:time_to_first_token_seconds"])


def _tgi(r: Reader) -> Extracted:
    """TGI exports its per-token time as a histogram; older builds as a gauge (seconds)."""
    per_token = "tgi_request_mean_time_per_token_duration"
    gauge_s = r.gauge("itl_ms", [per_token], max)
    fields: Fields = {
        "queue": r.gauge("queue", ["tgi_queue_size"], fsum),
        "running": r.gauge("running", ["tgi_batch_current_size"], fsum),
        "itl_ms": None if gauge_s is None else gauge_s * 1000.0,
    }
    return fields, _histograms(r, [per_token], [])


def _trt_kv(r: Reader) -> tuple[float | None, float | None]:
    """(kv_usage, kv_capacity_tokens) from Triton block metrics, else ``trtllm_*`` gauges."""

    def blocks(kind: str) -> float | None:
        where = {"kv_cache_block_type": kind}
        return r.gauge("kv_usage", [_TRT_BLOCKS], fsum, where=where)

    used, top, free, per = blocks("used"), blocks("max"), blocks("free"), blocks("tokens_per")
    capacity = top * per if top and per else None
    fraction = r.gauge(
        "kv_usage", [_TRT_BLOCKS], max, (0, 1), where={"kv_cache_block_type": "fraction"}
    )
    if fraction is None and used is not None:
        total = top if top else (used + free if free is not None else None)
        if total:
            fraction = used / total
            if not valid(fraction, 0.0, 1.0):
                r.reject("kv_usage", _TRT_BLOCKS, f"used/total is {fraction!r}")
                fraction = None
    if fraction is None:
        fraction = r.gauge("kv_usage", prefixed(["kv_cache_utilization"], _TRT), max, (0, 1))
    return fraction, capacity


def _trtllm(r: Reader) -> Extracted:
    def requests(signal: str, kind: str) -> float | None:
        return r.gauge(signal, [_TRT_REQUESTS], fsum, where={"request_type": kind})

    queue = requests("queue", "waiting")
    if queue is None:
        queue = r.gauge("queue", prefixed(["num_requests_waiting"], _TRT), fsum)
    running = requests("running", "scheduled")
    if running is None:
        running = requests("running", "active")
    if running is None:
        running = r.gauge("running", prefixed(["num_requests_running"], _TRT), fsum)
    kv_usage, capacity = _trt_kv(r)
    fields: Fields = {
        "queue": queue,
        "running": running,
        "kv_usage": kv_usage,
        "kv_capacity_tokens": capacity,
    }
    itl = prefixed(["inter_token_latency_seconds", "time_per_output_token_seconds"], _TRT)
    return fields, _histograms(r, itl, prefixed(["time_to_first_token_seconds"], _TRT))


EXTRACTORS: Mapping[str, Callable[[Reader], Extracted]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "tgi": _tgi,
    "trtllm": _trtllm,
}
