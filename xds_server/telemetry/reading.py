"""One endpoint's reading of one metrics page, typed, and the bounds every signal must meet.

:class:`PageReading` names the signals trimtab reads (see :mod:`xds_server.telemetry.parsers`
for the page formats):


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
between reads); a counter that went backwards (a restart) is handled there. Latency
histograms are kept raw (:class:`HistogramState`, cumulative ``sum``/``count``) under
``histograms["itl"]`` and ``histograms["ttft"]``; the canary gates' bucket counters under
``slo`` (:class:`SloCounters`). Pure code: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HistogramState:
    """Cumulative ``_sum`` and ``_count`` of one histogram (summed over its series)."""

    sum: float
    count: float


@dataclass(frozen=True)
class SloCounters:
    """The cumulative counters one page gives the canary gates: latency buckets by upper
    bound (``le``, seconds; ``+Inf`` included) and finished / failed requests.

    Deltas between two reads of one endpoint (:meth:`since`) and sums over a version's
    endpoints (:meth:`plus`) stay counters of the same shape."""

    ttft: Mapping[float, float] = field(default_factory=dict)
    itl: Mapping[float, float] = field(default_factory=dict)
    requests: float = 0.0
    errors: float = 0.0

    def since(self, older: SloCounters) -> SloCounters:
        """What happened between ``older`` and this read; a counter that went down means
        the server restarted, and then this read counts alone."""
        pairs = ((self.ttft, older.ttft), (self.itl, older.itl))
        went_down = (self.requests < older.requests or self.errors < older.errors
                     or any(new.get(k, 0.0) < v for new, old in pairs for k, v in old.items()))
        if went_down:
            return self
        return SloCounters(_minus(self.ttft, older.ttft), _minus(self.itl, older.itl),
                           self.requests - older.requests, self.errors - older.errors)

    def plus(self, other: SloCounters) -> SloCounters:
        return SloCounters(_plus(self.ttft, other.ttft), _plus(self.itl, other.itl),
                           self.requests + other.requests, self.errors + other.errors)


def _minus(new: Mapping[float, float], old: Mapping[float, float]) -> dict[float, float]:
    return {k: v - old.get(k, 0.0) for k, v in new.items()}


def _plus(a: Mapping[float, float], b: Mapping[float, float]) -> dict[float, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}


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
    slo: SloCounters | None = None  # read only when a rollout gate needs it

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


COUNTERS = frozenset({"requests_done", "prompt_tokens", "generation_tokens"})  # not load
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
        if number and valid(float(value), lo, hi):
            clean[name] = float(value)
        else:
            problems.append(f"{name}: value {value!r} rejected, outside [{lo:g}, {hi:g}]")
    return clean, tuple(problems)


def valid(value: float, lo: float, hi: float) -> bool:
    return math.isfinite(value) and lo <= value <= hi
