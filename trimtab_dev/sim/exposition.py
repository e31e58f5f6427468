"""What a simulated server reports about itself: the ORCA ``endpoint-load-metrics``
header Envoy's client_side_weighted_round_robin reads, and ``/metrics`` in vLLM's and the
DCGM exporter's names, both rendered from the live engine at the moment they are asked for."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from trimtab_dev.sim.engine import Engine, Histogram

if TYPE_CHECKING:
    from trimtab_dev.sim.server import SimServer


# ---- ORCA -------------------------------------------------------------------------------
def occupancy(engine: Engine) -> float:
    """Batch occupancy: the binding share of KV blocks or sequence slots in use, plus the
    waiting queue in units of ``max_num_seqs``. 1.0 means full; above 1.0, requests queue."""
    seqs = engine.gpu.max_num_seqs
    return max(engine.kv_usage, engine.num_running / seqs) + engine.num_waiting / seqs


ORCA_UTILIZATION: dict[str, Callable[[Engine], float | None]] = {
    "occupancy": occupancy,
    "kv_cache": lambda e: e.kv_usage,
    "gpu_busy": lambda e: e.busy_fraction(),
    "none": lambda e: None,
}


def orca_header(server: SimServer) -> str:
    """The ``endpoint-load-metrics`` value in ORCA's native-HTTP TEXT form.

    Envoy (source/common/orca/orca_parser.cc) wants ``TEXT `` then comma-separated
    ``key=value`` pairs (``key:value`` is accepted too). Fields:

    * ``application_utilization``: by default :func:`occupancy` (fleet option
      ``orca_utilization``: occupancy, kv_cache, gpu_busy, or none to leave it out).
      client_side_weighted_round_robin prefers it over everything else and sets
      weight = rps_fractional / utilization.
    * ``cpu_utilization``: GPU busy fraction over the last second (what
      DCGM_FI_DEV_GPU_UTIL / 100 shows); CSWRR's fallback.
    * ``mem_utilization``: KV-cache usage, 0..1 (FB memory is preallocated and flat).
    * ``rps_fractional``: completed requests/s over the last 10 s (CSWRR ignores a report
      whose rps is 0). ``eps``: 5xx/429 answers per second over the same window.
    * ``named_metrics.*``: vLLM's own ORCA names (kv_cache_usage_perc,
      num_requests_waiting) plus num_requests_running.
    """
    e = server.engine
    app = ORCA_UTILIZATION[server.config.orca_utilization](e)
    pairs = (
        *((("application_utilization", app),) if app is not None else ()),
        ("cpu_utilization", e.busy_fraction()),
        ("mem_utilization", e.kv_usage),
        ("rps_fractional", e.completion_rate()),
        ("eps", server.error_rate()),
        ("named_metrics.kv_cache_usage_perc", e.kv_usage),
        ("named_metrics.num_requests_waiting", float(e.num_waiting)),
        ("named_metrics.num_requests_running", float(e.num_running)),
    )
    return "TEXT " + ", ".join(f"{k}={v:.4g}" for k, v in pairs)


# ---- /metrics ---------------------------------------------------------------------------
class MetricsCollector:
    """Renders one server's live state with vLLM's and DCGM's metric names."""

    def __init__(self, server: SimServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        yield from self._vllm_gauges()
        yield from self._vllm_counters()
        yield from self._vllm_histograms()
        yield from self._dcgm()

    def _labels(self) -> tuple[list[str], list[str]]:
        return ["model_name", "engine"], [self.server.config.served_model_name, "0"]

    def _vllm_gauges(self) -> Iterator[Metric]:
        e = self.server.engine
        names, values = self._labels()
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             e.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             e.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "num_gpu_blocks",
                                         "gpu_memory_utilization", "enable_prefix_caching",
                                         "engine"])
        gpu = self.server.config.gpu
        info.add_metric([str(gpu.block_size), "auto", str(e.total_blocks),
                         str(gpu.gpu_memory_utilization), "True", "0"], 1.0)
        yield info

    def _vllm_counters(self) -> Iterator[Metric]:
        s = self.server.engine.stats
        names, values = self._labels()
        for name, doc, value in (
            ("vllm:prompt_tokens_total", "Number of prefill tokens processed.",
             s.prompt_tokens),
            ("vllm:generation_tokens_total", "Number of generation tokens processed.",
             s.generation_tokens),
            ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
             s.preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, float(value))
            yield c
        ok = CounterMetricFamily("vllm:request_success_total",
                                 "Count of successfully processed requests.",
                                 labels=[*names, "finished_reason"])
        ok.add_metric([*values, "length"], float(s.success))
        yield ok

    def _vllm_histograms(self) -> Iterator[Metric]:
        s = self.server.engine.stats
        names, values = self._labels()
        for name, doc, hist in (
            ("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", s.ttft),
            ("vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", s.itl),
            ("vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", s.e2e),
        ):
            yield _histogram(name, doc, names, values, hist)

    def _dcgm(self) -> Iterator[Metric]:
        srv, gpu = self.server, self.server.config.gpu
        names = ["gpu", "UUID", "device", "modelName", "Hostname"]
        values = ["0", srv.uuid, "nvidia0", gpu.dcgm_model_name, f"sim-{srv.config.name}"]
        used = math.floor(gpu.memory_mib * gpu.gpu_memory_utilization)
        for name, doc, value in (
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", used),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", gpu.memory_mib - used),
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).",
             round(100 * srv.engine.busy_fraction())),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(value))
            yield g


def _histogram(name: str, doc: str, names: list[str], values: list[str],
               hist: Histogram) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=names)
    h.add_metric(values, [(le, float(n)) for le, n in hist.cumulative()], hist.sum)
    return h


