"""Model-server and GPU metrics pages -> one typed reading per page.

:func:`parse_page` is the entry point (vLLM, SGLang, TGI, TensorRT-LLM and DCGM pages);
:mod:`.servers` maps each server's metric names, :mod:`.dcgm` the DCGM exporter's,
:mod:`.reader` does the lookups and records why a value was rejected.
"""

from xds_server.telemetry.parsers.page import SERVERS, detect_server, page_signals, parse_page

__all__ = ["SERVERS", "detect_server", "page_signals", "parse_page"]
