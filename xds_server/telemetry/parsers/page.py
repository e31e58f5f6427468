"""Parse one Prometheus text page: detect the server, extract its signals, read DCGM.

:func:`parse_page` recognises vLLM, SGLang, TGI, TensorRT-LLM (Triton ``nv_trt_llm_*`` and
``trtllm_*`` / ``trtllm:*``) and DCGM exporter metrics (:mod:`.servers`, :mod:`.dcgm`) and
returns a :class:`~xds_server.telemetry.reading.PageReading`. Pure code: no clocks, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from xds_server.telemetry.parsers.dcgm import dcgm_memory, dcgm_util
from xds_server.telemetry.parsers.reader import MetricsFormatError, Reader, index_page
from xds_server.telemetry.parsers.servers import EXTRACTORS
from xds_server.telemetry.parsers.slo import slo_counters
from xds_server.telemetry.reading import COUNTERS, PageReading

SERVERS = ("vllm", "sglang", "tgi", "trtllm")
_PREFIXES: Mapping[str, tuple[str, ...]] = {
    "vllm": ("vllm:",),
    "sglang": ("sglang:",),
    "tgi": ("tgi_",),
    "trtllm": ("nv_trt_llm_", "trtllm_", "trtllm:"),
}


def page_signals(text: str) -> dict[str, float]:
    """``parse_page(text).signals()``: a drop-in ``parse`` callable for ``Scraper``."""
    return parse_page(text).signals()




def detect_server(names: Iterable[str]) -> str | None:
    """The model-server type whose metric prefix appears first in :data:`SERVERS` order,
    ``"dcgm"`` when only DCGM metrics are present, else ``None``."""
    names = list(names)
    for server in SERVERS:
        if any(n.startswith(_PREFIXES[server]) for n in names):
            return server
    return "dcgm" if any(n.startswith("DCGM_FI_") for n in names) else None


def parse_page(text: str, *, gpu: str | None = None, uuid: str | None = None,
               with_slo: bool = False) -> PageReading:
    """Parse one Prometheus text page into a :class:`PageReading`.

    ``gpu`` (the DCGM ``gpu`` label, e.g. ``"0"``) and/or ``uuid`` (the ``UUID`` label) pick
    the GPU whose memory and utilisation are reported; without them the maximum over all
    GPUs on the page is used. Multiple model series (``model_name``, ``engine``...) are
    combined: queue/running/capacity summed, kv_usage maxed, histogram sums/counts summed.
    A present-but-invalid signal is dropped and described in ``problems``. ``with_slo``
    also reads the canary gates' counters (:mod:`.slo`) from the same parse.

    Raises :class:`~xds_server.telemetry.parsers.reader.MetricsFormatError` when the page does not parse,
    carries no recognised metrics, or none of its recognised signals survived validation.
    """
    index = index_page(text)
    server = detect_server(index)
    if server is None:
        raise MetricsFormatError("no recognised model-server or DCGM metrics on page")
    reader = Reader(index)
    fields, histograms = EXTRACTORS[server](reader) if server in EXTRACTORS else ({}, {})
    fields["gpu_mem_pct"] = dcgm_memory(reader, gpu, uuid)
    fields["gpu_util_pct"] = dcgm_util(reader, gpu, uuid)
    if all(v is None for k, v in fields.items() if k not in COUNTERS) and not histograms:
        detail = "; ".join(reader.problems) or "no known signal metric present"
        raise MetricsFormatError(f"{server} page has no usable signal: {detail}")
    return PageReading(
        server=server,
        histograms=histograms,
        problems=tuple(reader.problems),
        has_dcgm=any(n.startswith("DCGM_FI_") for n in index),
        slo=slo_counters(index) if with_slo else None,
        **fields,  # type: ignore[arg-type]
    )
