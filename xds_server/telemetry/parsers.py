"""Model-server adapters: one Prometheus text page -> normalised load signals.

:func:`parse_page` recognises vLLM, SGLang, TGI, TensorRT-LLM (Triton ``nv_trt_llm_*`` and
``trtllm_*`` / ``trtllm:*``) and DCGM exporter metrics, and maps them onto our signal names:

=====================  ==================================================================
``queue``              waiting requests (summed over model series)
``running``            running requests (summed over model series)
``kv_usage``           KV-cache use, 0..1 (max over model series)
``gpu_mem_pct``        DCGM framebuffer use, 0..100 (one GPU, or the busiest)
``gpu_util_pct``       DCGM GPU utilisation, 0..100 (same GPU selection)
``kv_capacity_tokens`` KV-cache size in tokens (summed over model series)
``itl_ms``             inter-token latency, only where a server exports it as a gauge
``requests_done``      vLLM: finished requests, cumulative (``vllm:request_success_total``)
``prompt_tokens``      vLLM: prefill tokens computed, cumulative (``vllm:prompt_tokens_total``)
``generation_tokens``  vLLM: tokens generated, cumulative (``vllm:generation_tokens_total``)
=====================  ==================================================================

The three counters feed the ``queueing`` weight policy's service-rate estimate (their deltas
between reads); a counter that went backwards (a restart) is handled there.

Latency histograms are kept raw (:class:`HistogramState`, cumulative ``sum``/``count``) under
``histograms["itl"]`` and ``histograms["ttft"]``; turn successive states into a mean with
:func:`windowed_mean` (or :class:`HistogramHistory`). Pure code: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from xds_server.telemetry.scrape import FB_FREE, FB_USED, MetricsFormatError

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
SERVERS = ("vllm", "sglang", "tgi", "trtllm")
_PREFIXES: Mapping[str, tuple[str, ...]] = {
    "vllm": ("vllm:",),
    "sglang": ("sglang:",),
    "tgi": ("tgi_",),
    "trtllm": ("nv_trt_llm_", "trtllm_", "trtllm:"),
}
_TRT_REQUESTS = "nv_trt_llm_request_metrics"
_TRT_BLOCKS = "nv_trt_llm_kv_cache_block_metrics"
_TRT = ("trtllm_", "trtllm:")

Labels = Mapping[str, str]
Series = tuple[Labels, float]


@dataclass(frozen=True)
class HistogramState:
    """Cumulative ``_sum`` and ``_count`` of one histogram (summed over its series)."""

    sum: float
    count: float


@dataclass(frozen=True)
class PageReading:
    """Signals read from one metrics page; ``None`` means absent or rejected.

    ``server`` is ``"vllm"``, ``"sglang"``, ``"tgi"``, ``"trtllm"`` or, for a page that only
    carries DCGM metrics, ``"dcgm"``. ``has_dcgm`` says whether DCGM metrics were present.
    ``problems`` lists every signal that was present but rejected (NaN, negative, out of
    range, unpaired), one human-readable line each.
    """

    server: str
    queue: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    gpu_mem_pct: float | None = None
    gpu_util_pct: float | None = None
    kv_capacity_tokens: float | None = None
    itl_ms: float | None = None
    requests_done: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    histograms: Mapping[str, HistogramState] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    has_dcgm: bool = False

    def signals(self) -> dict[str, float]:
        """Flat ``name -> value`` view for :class:`~weight_calculator.types.Sample`.

        Histograms appear as ``<name>_sum`` / ``<name>_count`` (seconds / observations);
        rebuild them with :func:`histogram_from_signals`.
        """
        out = {name: value for name in _GAUGES if (value := getattr(self, name)) is not None}
        for name, state in self.histograms.items():
            out[f"{name}_sum"] = state.sum
            out[f"{name}_count"] = state.count
        return out


_COUNTERS = frozenset({"requests_done", "prompt_tokens", "generation_tokens"})  # not load
_GAUGES = (
    "queue",
    "running",
    "kv_usage",
    "gpu_mem_pct",
    "gpu_util_pct",
    "kv_capacity_tokens",
    "itl_ms",
    "requests_done",
    "prompt_tokens",
    "generation_tokens",
)


def histogram_from_signals(signals: Mapping[str, float], name: str) -> HistogramState | None:
    """The :class:`HistogramState` stored by :meth:`PageReading.signals`, or ``None``."""
    total, count = signals.get(f"{name}_sum"), signals.get(f"{name}_count")
    if total is None or count is None:
        return None
    return HistogramState(sum=total, count=count)


def page_signals(text: str) -> dict[str, float]:
    """``parse_page(text).signals()``: a drop-in ``parse`` callable for ``Scraper``."""
    return parse_page(text).signals()


# Valid range of each normalised signal (inclusive); histogram ``_sum``/``_count`` are >= 0
# and any other signal only has to be finite.
SIGNAL_BOUNDS: Mapping[str, tuple[float, float]] = {
    "queue": (0.0, math.inf),
    "running": (0.0, math.inf),
    "kv_usage": (0.0, 1.0),
    "gpu_mem_pct": (0.0, 100.0),
    "gpu_util_pct": (0.0, 100.0),
    "kv_capacity_tokens": (1.0, math.inf),
    "capacity": (1.0, math.inf),
    "itl_ms": (0.0, math.inf),
    "requests_done": (0.0, math.inf),
    "prompt_tokens": (0.0, math.inf),
    "generation_tokens": (0.0, math.inf),
}
_ANY = (-math.inf, math.inf)
_COUNTER = (0.0, math.inf)


def _bounds(name: str) -> tuple[float, float]:
    found = SIGNAL_BOUNDS.get(name)
    if found is not None:
        return found
    return _COUNTER if name.endswith(("_sum", "_count")) else _ANY


def screen_signals(signals: Mapping[str, float]) -> tuple[dict[str, float], tuple[str, ...]]:
    """``(valid signals, problems)``: a NaN, infinite, non-numeric or out-of-range value is
    dropped and described, so that it can never reach a weight, whatever the source."""
    clean: dict[str, float] = {}
    problems: list[str] = []
    for name, value in signals.items():
        lo, hi = _bounds(name)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and _valid(float(value), lo, hi):
            clean[name] = float(value)
        else:
            problems.append(f"{name}: value {value!r} rejected, outside [{lo:g}, {hi:g}]")
    return clean, tuple(problems)


# --- page indexing ----------------------------------------------------------------------------


def _index(text: str) -> dict[str, list[Series]]:
    """Every sample on the page, keyed by its exposed sample name (``_total`` kept)."""
    index: dict[str, list[Series]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                index.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except Exception as exc:  # the parser raises bare ValueError/TypeError/IndexError
        raise MetricsFormatError(f"not a Prometheus text page: {exc}") from exc
    return index


def _valid(value: float, lo: float, hi: float) -> bool:
    return math.isfinite(value) and lo <= value <= hi


class _Reader:
    """Looks signals up on an indexed page and records why any was rejected."""

    def __init__(self, index: Mapping[str, list[Series]]) -> None:
        self.index = index
        self.problems: list[str] = []

    def values(self, name: str, where: Labels | None = None) -> list[float]:
        rows = self.index.get(name, [])
        if where:
            rows = [r for r in rows if all(r[0].get(k) == v for k, v in where.items())]
        return [value for _, value in rows]

    def reject(self, signal: str, source: str, detail: str) -> None:
        self.problems.append(f"{signal}: {source} {detail}")

    def gauge(
        self,
        signal: str,
        names: Sequence[str],
        combine: Callable[[Iterable[float]], float],
        bounds: tuple[float, float] = (0.0, math.inf),
        where: Labels | None = None,
    ) -> float | None:
        """First of ``names`` present on the page, all its series combined; else ``None``."""
        for name in names:
            values = self.values(name, where)
            if not values:
                continue
            bad = [v for v in values if not _valid(v, *bounds)]
            if bad:
                self.reject(signal, _label(name, where), f"is {bad[0]!r}, outside {bounds}")
                return None
            combined = combine(values)
            if not _valid(combined, *bounds):
                self.reject(signal, _label(name, where), f"combines to {combined!r}")
                return None
            return combined
        return None

    def histogram(self, key: str, bases: Sequence[str]) -> HistogramState | None:
        """First histogram (or summary) of ``bases`` with both ``_sum`` and ``_count``."""
        for base in bases:
            sums, counts = self.values(f"{base}_sum"), self.values(f"{base}_count")
            if not sums or not counts:
                continue
            bad = [v for v in sums + counts if not _valid(v, 0.0, math.inf)]
            if bad:
                self.reject(key, base, f"has sum/count {bad[0]!r}")
                return None
            total, count = _fsum(sums), _fsum(counts)
            if not (math.isfinite(total) and math.isfinite(count)):
                self.reject(key, base, "sum/count overflow")
                return None
            return HistogramState(sum=total, count=count)
        return None


def _label(name: str, where: Labels | None) -> str:
    if not where:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in where.items())
    return f"{name}{{{inner}}}"


def _names(stems: Sequence[str], prefixes: Sequence[str]) -> list[str]:
    return [prefix + stem for stem in stems for prefix in prefixes]


def _fsum(values: Iterable[float]) -> float:
    """Exact sum; an overflow is infinite, which validation then rejects (found by fuzzing)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


# --- per-server extractors --------------------------------------------------------------------

Fields = dict[str, float | None]
Extracted = tuple[Fields, dict[str, HistogramState]]


def _histograms(r: _Reader, itl: Sequence[str], ttft: Sequence[str]) -> dict[str, HistogramState]:
    found = {"itl": r.histogram("itl", itl), "ttft": r.histogram("ttft", ttft)}
    return {key: state for key, state in found.items() if state is not None}


def _vllm_capacity(r: _Reader) -> float | None:
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
        if not _valid(tokens, 1.0, math.inf):
            r.reject("kv_capacity_tokens", "vllm:cache_config_info", f"gives {tokens!r} tokens")
            return None
        total += tokens
    return total


def _vllm(r: _Reader) -> Extracted:
    fields: Fields = {
        "queue": r.gauge("queue", ["vllm:num_requests_waiting"], _fsum),
        "running": r.gauge("running", ["vllm:num_requests_running"], _fsum),
        "kv_usage": r.gauge(
            "kv_usage", ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"], max, (0, 1)
        ),
        "kv_capacity_tokens": _vllm_capacity(r),
        # counters: the parser names a counter's sample ``<name>_total``
        "requests_done": r.gauge("requests_done", ["vllm:request_success_total"], _fsum),
        "prompt_tokens": r.gauge("prompt_tokens", ["vllm:prompt_tokens_total"], _fsum),
        "generation_tokens": r.gauge("generation_tokens", ["vllm:generation_tokens_total"],
                                     _fsum),
    }
    itl = ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"]
    return fields, _histograms(r, itl, ["vllm:time_to_first_token_seconds"])


def _sglang(r: _Reader) -> Extracted:
    fields: Fields = {
        "queue": r.gauge("queue", ["sglang:num_queue_reqs"], _fsum),
        "running": r.gauge("running", ["sglang:num_running_reqs"], _fsum),
        "kv_usage": r.gauge("kv_usage", ["sglang:token_usage"], max, (0, 1)),
    }
    itl = ["sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"]
    return fields, _histograms(r, itl, ["sglang:time_to_first_token_seconds"])


def _tgi(r: _Reader) -> Extracted:
    """TGI exports its per-token time as a histogram; older builds as a gauge (seconds)."""
    per_token = "tgi_request_mean_time_per_token_duration"
    gauge_s = r.gauge("itl_ms", [per_token], max)
    fields: Fields = {
        "queue": r.gauge("queue", ["tgi_queue_size"], _fsum),
        "running": r.gauge("running", ["tgi_batch_current_size"], _fsum),
        "itl_ms": None if gauge_s is None else gauge_s * 1000.0,
    }
    return fields, _histograms(r, [per_token], [])


def _trt_kv(r: _Reader) -> tuple[float | None, float | None]:
    """(kv_usage, kv_capacity_tokens) from Triton block metrics, else ``trtllm_*`` gauges."""

    def blocks(kind: str) -> float | None:
        where = {"kv_cache_block_type": kind}
        return r.gauge("kv_usage", [_TRT_BLOCKS], _fsum, where=where)

    used, top, free, per = blocks("used"), blocks("max"), blocks("free"), blocks("tokens_per")
    capacity = top * per if top and per else None
    fraction = r.gauge(
        "kv_usage", [_TRT_BLOCKS], max, (0, 1), where={"kv_cache_block_type": "fraction"}
    )
    if fraction is None and used is not None:
        total = top if top else (used + free if free is not None else None)
        if total:
            fraction = used / total
            if not _valid(fraction, 0.0, 1.0):
                r.reject("kv_usage", _TRT_BLOCKS, f"used/total is {fraction!r}")
                fraction = None
    if fraction is None:
        fraction = r.gauge("kv_usage", _names(["kv_cache_utilization"], _TRT), max, (0, 1))
    return fraction, capacity


def _trtllm(r: _Reader) -> Extracted:
    def requests(signal: str, kind: str) -> float | None:
        return r.gauge(signal, [_TRT_REQUESTS], _fsum, where={"request_type": kind})

    queue = requests("queue", "waiting")
    if queue is None:
        queue = r.gauge("queue", _names(["num_requests_waiting"], _TRT), _fsum)
    running = requests("running", "scheduled")
    if running is None:
        running = requests("running", "active")
    if running is None:
        running = r.gauge("running", _names(["num_requests_running"], _TRT), _fsum)
    kv_usage, capacity = _trt_kv(r)
    fields: Fields = {
        "queue": queue,
        "running": running,
        "kv_usage": kv_usage,
        "kv_capacity_tokens": capacity,
    }
    itl = _names(["inter_token_latency_seconds", "time_per_output_token_seconds"], _TRT)
    return fields, _histograms(r, itl, _names(["time_to_first_token_seconds"], _TRT))


_EXTRACTORS: Mapping[str, Callable[[_Reader], Extracted]] = {
    "vllm": _vllm,
    "sglang": _sglang,
    "tgi": _tgi,
    "trtllm": _trtllm,
}


# --- DCGM -------------------------------------------------------------------------------------

GpuKey = tuple[str, str]  # (gpu index label, UUID label)


def _per_gpu(r: _Reader, name: str, gpu: str | None, uuid: str | None) -> dict[GpuKey, float]:
    """Value per (gpu, UUID) among the selected GPUs; duplicates keep the max (NaN wins)."""
    grouped: dict[GpuKey, list[float]] = {}
    for labels, value in r.index.get(name, []):
        key = (labels.get("gpu", ""), labels.get("UUID", ""))
        if (gpu is None or key[0] == gpu) and (uuid is None or key[1] == uuid):
            grouped.setdefault(key, []).append(value)
    return {
        key: math.nan if any(math.isnan(v) for v in values) else max(values)
        for key, values in grouped.items()
    }


def _selection(gpu: str | None, uuid: str | None) -> str:
    parts = [f"gpu={gpu!r}" if gpu is not None else "", f"UUID={uuid!r}" if uuid else ""]
    return " ".join(p for p in parts if p) or "any GPU"


def _dcgm_memory(r: _Reader, gpu: str | None, uuid: str | None) -> float | None:
    """Framebuffer use in percent of the selected GPU, or of the busiest one."""
    if FB_USED not in r.index and FB_FREE not in r.index:
        return None
    used, free = _per_gpu(r, FB_USED, gpu, uuid), _per_gpu(r, FB_FREE, gpu, uuid)
    if not used and not free:
        r.reject("gpu_mem_pct", "DCGM", f"has no series for {_selection(gpu, uuid)}")
        return None
    if used.keys() != free.keys():
        unpaired = sorted(used.keys() ^ free.keys())
        r.reject("gpu_mem_pct", f"{FB_USED}/{FB_FREE}", f"not paired for {unpaired}")
        return None
    best: float | None = None
    for key in sorted(used):
        u, f = used[key], free[key]
        if not (_valid(u, 0.0, math.inf) and _valid(f, 0.0, math.inf)) or u + f == 0:
            r.reject("gpu_mem_pct", f"{FB_USED}/{FB_FREE}", f"are {u!r}/{f!r} for {key}")
            return None
        pct = 100.0 * u / (u + f)
        best = pct if best is None else max(best, pct)
    return best


def _dcgm_util(r: _Reader, gpu: str | None, uuid: str | None) -> float | None:
    if GPU_UTIL not in r.index:
        return None
    values = _per_gpu(r, GPU_UTIL, gpu, uuid)
    if not values:
        r.reject("gpu_util_pct", GPU_UTIL, f"has no series for {_selection(gpu, uuid)}")
        return None
    bad = [v for v in values.values() if not _valid(v, 0.0, 100.0)]
    if bad:
        r.reject("gpu_util_pct", GPU_UTIL, f"is {bad[0]!r}, outside (0, 100)")
        return None
    return max(values.values())


# --- entry points -----------------------------------------------------------------------------


def detect_server(names: Iterable[str]) -> str | None:
    """The model-server type whose metric prefix appears first in :data:`SERVERS` order,
    ``"dcgm"`` when only DCGM metrics are present, else ``None``."""
    names = list(names)
    for server in SERVERS:
        if any(n.startswith(_PREFIXES[server]) for n in names):
            return server
    return "dcgm" if any(n.startswith("DCGM_FI_") for n in names) else None


def parse_page(text: str, *, gpu: str | None = None, uuid: str | None = None) -> PageReading:
    """Parse one Prometheus text page into a :class:`PageReading`.

    ``gpu`` (the DCGM ``gpu`` label, e.g. ``"0"``) and/or ``uuid`` (the ``UUID`` label) pick
    the GPU whose memory and utilisation are reported; without them the maximum over all
    GPUs on the page is used. Multiple model series (``model_name``, ``engine``...) are
    combined: queue/running/capacity summed, kv_usage maxed, histogram sums/counts summed.
    A present-but-invalid signal is dropped and described in ``problems``.

    Raises :class:`~xds_server.telemetry.scrape.MetricsFormatError` when the page does not parse,
    carries no recognised metrics, or none of its recognised signals survived validation.
    """
    index = _index(text)
    server = detect_server(index)
    if server is None:
        raise MetricsFormatError("no recognised model-server or DCGM metrics on page")
    reader = _Reader(index)
    fields, histograms = _EXTRACTORS[server](reader) if server in _EXTRACTORS else ({}, {})
    fields["gpu_mem_pct"] = _dcgm_memory(reader, gpu, uuid)
    fields["gpu_util_pct"] = _dcgm_util(reader, gpu, uuid)
    if all(v is None for k, v in fields.items() if k not in _COUNTERS) and not histograms:
        detail = "; ".join(reader.problems) or "no known signal metric present"
        raise MetricsFormatError(f"{server} page has no usable signal: {detail}")
    return PageReading(
        server=server,
        histograms=histograms,
        problems=tuple(reader.problems),
        has_dcgm=any(n.startswith("DCGM_FI_") for n in index),
        **fields,  # type: ignore[arg-type]
    )


def windowed_mean(
    history: Sequence[tuple[float, HistogramState]], now: float, window_s: float
) -> float | None:
    """Mean observation over the last ``window_s`` seconds from cumulative histogram states.

    Uses the samples with ``now - window_s <= t <= now`` (in time order): the mean is
    ``Δsum / Δcount`` between the oldest and the newest of them. If a counter went down
    between any two of them (a server restart), the newest state alone is used, since it
    counts exactly the observations since the reset. Returns ``None`` when fewer than two
    samples fall in the window (and no reset), or no new observations were made.
    """
    inside = sorted(
        ((t, s) for t, s in history if now - window_s <= t <= now), key=lambda item: item[0]
    )
    if not inside:
        return None
    newest = inside[-1][1]
    states = [s for _, s in inside]
    if any(b.count < a.count or b.sum < a.sum for a, b in zip(states, states[1:], strict=False)):
        return newest.sum / newest.count if newest.count > 0 else None
    oldest = states[0]
    d_count = newest.count - oldest.count
    if d_count <= 0:
        return None
    return (newest.sum - oldest.sum) / d_count


class HistogramHistory:
    """Bounded per-key history of :class:`HistogramState` for :func:`windowed_mean`.

    Keys are free-form (e.g. ``(address, "itl")``). Not thread-safe; use from one task.
    """

    def __init__(self, window_s: float, max_samples: int = 64) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be finite and > 0, got {window_s!r}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self.window_s = window_s
        self._max = max_samples
        self._data: dict[object, deque[tuple[float, HistogramState]]] = {}

    def record(self, key: object, at: float, state: HistogramState) -> None:
        """Append one state read at time ``at``."""
        self._data.setdefault(key, deque(maxlen=self._max)).append((at, state))

    def mean(self, key: object, now: float) -> float | None:
        """:func:`windowed_mean` of ``key``'s history (``None`` if unknown)."""
        history = self._data.get(key)
        return None if history is None else windowed_mean(history, now, self.window_s)

    def forget(self, keep: Callable[[object], bool]) -> None:
        """Drop every key for which ``keep(key)`` is false."""
        for key in [k for k in self._data if not keep(k)]:
            del self._data[key]
