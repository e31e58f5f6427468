"""Telemetry sources. Each pool reads its endpoints through one of them:

* ``scrape``: GET each endpoint's metrics page (and its node's DCGM exporter, when
  ``dcgm_url`` is set); the model server is detected from the metric names on the page.
* ``prometheus``: one PromQL query per signal per tick to a Prometheus that already scrapes
  the fleet, mapping a label (default ``instance``) to endpoints.
* ``static``: the ``signals`` written in the config (dry runs, tests).
* ``file``: a YAML/JSON file ``{address: {signal: value}}`` re-read every tick.

Every source answers with one `ScrapeResult` per endpoint: signals, or an error that makes
only that endpoint stale. Parsing and per-endpoint work run on the telemetry worker thread
(`telemetry.off_loop`), so a big page or a big fleet never holds up the event loop. Inputs that were present but rejected (NaN, negative, out of range)
or that partly failed (a node's DCGM page, one failed PromQL query) go to the result's
``problems``: the read still counts, the endpoint is flagged, the value is never a signal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from xds_server.config.load import MAX_CONFIG_BYTES, ConfigError, load_yaml_text
from xds_server.config.pools import EndpointConfig
from xds_server.config.schema import Config
from xds_server.telemetry.parsers import parse_page
from xds_server.telemetry.promql import PromQLResult, PromQLSource
from xds_server.telemetry.scrape import ParsedPage, Scraper, ScrapeResult
from xds_server.telemetry.worker import off_loop

Clock = Callable[[], float]
_DCGM_SIGNALS = ("gpu_mem_pct", "gpu_util_pct")
_DCGM_PREFIXES = tuple(f"{name}:" for name in _DCGM_SIGNALS)


class TelemetrySource(Protocol):
    async def collect(self, endpoints: list[EndpointConfig], now: Clock
                      ) -> dict[str, ScrapeResult]: ...

    async def close(self) -> None: ...


def page_parser(gpu: str | None, uuid: str | None, with_slo: bool
                ) -> Callable[[str], ParsedPage]:
    def parse(text: str) -> ParsedPage:
        reading = parse_page(text, gpu=gpu, uuid=uuid, with_slo=with_slo)
        return ParsedPage(reading.signals(), reading.problems, reading.slo,
                          reading.histograms.get("itl"))
    return parse


def _dcgm_only(gpu: str | None, uuid: str | None) -> Callable[[str], ParsedPage]:
    def parse(text: str) -> ParsedPage:
        reading = parse_page(text, gpu=gpu, uuid=uuid)
        signals = {k: v for k, v in reading.signals().items() if k in _DCGM_SIGNALS}
        problems = tuple(p for p in reading.problems if p.startswith(_DCGM_PREFIXES))
        return ParsedPage(signals, problems)
    return parse


def _by_selection(endpoints: Iterable[EndpointConfig]
                  ) -> dict[tuple[str | None, str | None], list[EndpointConfig]]:
    groups: dict[tuple[str | None, str | None], list[EndpointConfig]] = {}
    for endpoint in endpoints:
        groups.setdefault((endpoint.gpu, endpoint.uuid), []).append(endpoint)
    return groups


class ScrapeSource:
    """Model-server pages and DCGM pages, all scraped concurrently in one tick.

    When an endpoint's DCGM page fails but its model page answers, the read still counts
    (model signals), the failure is reported in ``problems`` and the last good DCGM
    signals are kept for at most ``hold_seconds`` (then dropped)."""

    def __init__(self, scraper: Scraper, with_slo: bool, hold_seconds: float = 0.0) -> None:
        self.scraper = scraper
        self.with_slo = with_slo
        self.hold_seconds = hold_seconds
        self._good_dcgm: dict[str, ScrapeResult] = {}  # address -> last good DCGM read

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        kinds: list[bool] = []  # per job: is it a DCGM scrape?
        jobs: list[Awaitable[dict[str, ScrapeResult]]] = []
        for (gpu, uuid), group in _by_selection(endpoints).items():
            pages = {ep.address: ep.scrape_url for ep in group}
            kinds.append(False)
            jobs.append(self.scraper.scrape(pages, now, page_parser(gpu, uuid, self.with_slo)))
            node_pages = {ep.address: ep.dcgm_url for ep in group if ep.dcgm_url}
            if node_pages:
                kinds.append(True)
                jobs.append(self.scraper.scrape(node_pages, now, _dcgm_only(gpu, uuid)))
        results: dict[str, ScrapeResult] = {}
        dcgm: dict[str, ScrapeResult] = {}
        for is_dcgm, answer in zip(kinds, await asyncio.gather(*jobs), strict=True):
            (dcgm if is_dcgm else results).update(answer)
        self._remember(dcgm, {ep.address for ep in endpoints})
        return {address: self._merge(address, result, dcgm.get(address))
                for address, result in results.items()}

    def _remember(self, dcgm: Mapping[str, ScrapeResult], current: set[str]) -> None:
        good = {a: r for a, r in self._good_dcgm.items() if a in current}
        good.update((a, r) for a, r in dcgm.items() if r.signals is not None)
        self._good_dcgm = good

    def _merge(self, address: str, main: ScrapeResult, dcgm: ScrapeResult | None
               ) -> ScrapeResult:
        if dcgm is None or main.signals is None:
            return main
        if dcgm.signals is not None:
            return replace(main, signals={**main.signals, **dcgm.signals},
                           problems=main.problems + dcgm.problems)
        held = self._good_dcgm.get(address)
        if held is not None and held.signals and \
                main.collected_at - held.collected_at <= self.hold_seconds:
            note = (f"dcgm: {dcgm.error}; holding the last good {', '.join(sorted(held.signals))}"
                    f" (for at most {self.hold_seconds:g}s)")
            return replace(main, signals={**held.signals, **main.signals},
                           problems=main.problems + (note,))
        note = f"dcgm: {dcgm.error}; no {' or '.join(_DCGM_SIGNALS)} from it"
        return replace(main, problems=main.problems + (note,))

    async def close(self) -> None:
        await self.scraper.close()


class PrometheusSource:
    """One PromQL query per signal; series are mapped to endpoints by ``label`` (an
    endpoint's ``instance``, else its address). A failed query or a rejected series is
    reported in the ``problems`` of every endpoint it leaves without that signal."""

    def __init__(self, config: Config, timeout_seconds: float) -> None:
        settings = config.telemetry.prometheus
        self.source = PromQLSource(settings.url, label=settings.label, queries=settings.queries,
                                   timeout_seconds=timeout_seconds)

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        self.source.address_of = {ep.instance or ep.address: ep.address for ep in endpoints}
        answer = await self.source.fetch()
        return await off_loop(self._results, endpoints, answer, now())

    def _results(self, endpoints: list[EndpointConfig], answer: PromQLResult, at: float
                 ) -> dict[str, ScrapeResult]:
        failed = tuple(f"{signal}: {error}" for signal, error in sorted(answer.errors.items()))
        return {ep.address: self._result(ep, answer, failed, at) for ep in endpoints}

    def _result(self, endpoint: EndpointConfig, answer: PromQLResult, failed: tuple[str, ...],
                at: float) -> ScrapeResult:
        signals = answer.values.get(endpoint.address)
        problems = failed + tuple(answer.endpoint_problems.get(endpoint.address, ()))
        if signals:
            return ScrapeResult(dict(signals), None, at, problems)
        name = endpoint.instance or endpoint.address
        reason = "; ".join(problems) or f"no series with {self.source.label}={name!r}"
        return ScrapeResult(None, f"prometheus: {reason}", at, problems)

    async def close(self) -> None:
        await self.source.close()


class StaticSource:
    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        at = now()
        return {ep.address: ScrapeResult(dict(ep.signals or {}), None, at) for ep in endpoints}

    async def close(self) -> None:
        return None


class FileSource:
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _read(self) -> Mapping[str, Mapping[str, float]]:
        """The file within a config file's bounds (size, UTF-8, nesting, alias expansion):
        a hostile or broken file fails this tick's reads, never the tick."""
        with open(self.path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        try:
            data = load_yaml_text(raw.decode("utf-8"), self.path)
        except UnicodeDecodeError as exc:
            raise ValueError(f"not UTF-8 at offset {exc.start}") from None
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix(f"{self.path}: ")) from None
        if not isinstance(data, dict):
            raise ValueError("expected a mapping of address -> {signal: value}")
        return data

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        at = now()
        try:
            data = await off_loop(self._read)  # up to 4 MiB of YAML: never on the serving loop
        except (OSError, ValueError) as exc:
            return {ep.address: ScrapeResult(None, f"file: {self.path}: {exc}", at)
                    for ep in endpoints}
        out = {}
        for ep in endpoints:
            raw = data.get(ep.address)
            if not isinstance(raw, dict):
                out[ep.address] = ScrapeResult(None, f"file: no entry for {ep.address}", at)
                continue
            signals, problems = _file_signals(raw)
            out[ep.address] = ScrapeResult(signals, None, at, problems)
        return out

    async def close(self) -> None:
        return None


def _file_signals(raw: Mapping[object, object]) -> tuple[dict[str, float], tuple[str, ...]]:
    """Numbers (or numeric strings) as signals; anything else is a problem, not a signal."""
    signals: dict[str, float] = {}
    problems: list[str] = []
    for key, value in raw.items():
        try:
            if isinstance(value, bool):
                raise TypeError("a boolean is not a signal value")
            signals[str(key)] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            problems.append(f"{key}: value {value!r} rejected: {exc}")
    return signals, tuple(problems)


def build_sources(config: Config, scraper: Scraper, with_slo: bool) -> dict[str, TelemetrySource]:
    """One instance per source kind the config uses."""
    kinds = {pool.source(config) for pool in config.pools}
    hold = config.telemetry.stale_after_seconds
    sources: dict[str, TelemetrySource] = {"scrape": ScrapeSource(scraper, with_slo, hold)}
    if "prometheus" in kinds:
        sources["prometheus"] = PrometheusSource(config, config.telemetry.scrape_timeout)
    if "static" in kinds:
        sources["static"] = StaticSource()
    if "file" in kinds and config.telemetry.file is not None:
        sources["file"] = FileSource(config.telemetry.file)
    return sources
