"""Telemetry sources. Each pool reads its endpoints through one of them:

* ``scrape``: GET each endpoint's metrics page (and its node's DCGM exporter, when
  ``dcgm_url`` is set); the model server is detected from the metric names on the page.
* ``prometheus``: one PromQL query per signal per tick to a Prometheus that already scrapes
  the fleet, mapping a label (default ``instance``) to endpoints.
* ``static``: the ``signals`` written in the config (dry runs, tests).
* ``file``: a YAML/JSON file ``{address: {signal: value}}`` re-read every tick.

Every source answers with one `ScrapeResult` per endpoint: signals, or an error that makes
only that endpoint stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

import yaml

from .adapters import parse_page
from .config import Config, EndpointConfig
from .promql import PromQLSource
from .slo import parse_slo
from .telemetry import Scraper, ScrapeResult

Clock = Callable[[], float]
_DCGM_SIGNALS = ("gpu_mem_pct", "gpu_util_pct")


class TelemetrySource(Protocol):
    async def collect(self, endpoints: list[EndpointConfig], now: Clock
                      ) -> dict[str, ScrapeResult]: ...

    async def close(self) -> None: ...


def page_parser(gpu: str | None, uuid: str | None, with_slo: bool
                ) -> Callable[[str], dict[str, float]]:
    def parse(text: str) -> dict[str, float]:
        signals = parse_page(text, gpu=gpu, uuid=uuid).signals()
        if with_slo:
            signals.update(parse_slo(text))
        return signals
    return parse


def _dcgm_only(gpu: str | None, uuid: str | None) -> Callable[[str], dict[str, float]]:
    def parse(text: str) -> dict[str, float]:
        signals = parse_page(text, gpu=gpu, uuid=uuid).signals()
        return {k: v for k, v in signals.items() if k in _DCGM_SIGNALS}
    return parse


def _by_selection(endpoints: Iterable[EndpointConfig]
                  ) -> dict[tuple[str | None, str | None], list[EndpointConfig]]:
    groups: dict[tuple[str | None, str | None], list[EndpointConfig]] = {}
    for endpoint in endpoints:
        groups.setdefault((endpoint.gpu, endpoint.uuid), []).append(endpoint)
    return groups


def _merge_dcgm(main: ScrapeResult, dcgm: ScrapeResult | None) -> ScrapeResult:
    if dcgm is None or main.signals is None:
        return main
    if dcgm.signals is None:
        return ScrapeResult(main.signals, None, main.collected_at)  # model signals still count
    return ScrapeResult({**main.signals, **dcgm.signals}, None, main.collected_at)


class ScrapeSource:
    def __init__(self, scraper: Scraper, with_slo: bool) -> None:
        self.scraper = scraper
        self.with_slo = with_slo

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        results: dict[str, ScrapeResult] = {}
        dcgm: dict[str, ScrapeResult] = {}
        for (gpu, uuid), group in _by_selection(endpoints).items():
            targets = {ep.address: ep.scrape_url for ep in group}
            results.update(await self.scraper.scrape(targets, now,
                                                     page_parser(gpu, uuid, self.with_slo)))
            node_pages = {ep.address: ep.dcgm_url for ep in group if ep.dcgm_url}
            if node_pages:
                dcgm.update(await self.scraper.scrape(node_pages, now, _dcgm_only(gpu, uuid)))
        return {address: _merge_dcgm(result, dcgm.get(address))
                for address, result in results.items()}

    async def close(self) -> None:
        await self.scraper.close()


class PrometheusSource:
    def __init__(self, config: Config, timeout_seconds: float) -> None:
        settings = config.telemetry.prometheus
        self.source = PromQLSource(settings.url, label=settings.label, queries=settings.queries,
                                   timeout_seconds=timeout_seconds)

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        self.source.address_of = {ep.instance or ep.address: ep.address for ep in endpoints}
        answer = await self.source.fetch()
        at = now()
        errors = "; ".join(f"{signal}: {error}" for signal, error in sorted(answer.errors.items()))
        out = {}
        for endpoint in endpoints:
            signals = answer.values.get(endpoint.address)
            if signals:
                out[endpoint.address] = ScrapeResult(dict(signals), None, at)
            else:
                name = endpoint.instance or endpoint.address
                reason = errors or f"no series with {self.source.label}={name!r}"
                out[endpoint.address] = ScrapeResult(None, f"prometheus: {reason}", at)
        return out

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
        data = yaml.safe_load(self.path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("expected a mapping of address -> {signal: value}")
        return data

    async def collect(self, endpoints: list[EndpointConfig], now: Clock) -> dict[str, ScrapeResult]:
        at = now()
        try:
            data = self._read()
        except (OSError, ValueError, yaml.YAMLError) as exc:
            return {ep.address: ScrapeResult(None, f"file: {self.path}: {exc}", at)
                    for ep in endpoints}
        out = {}
        for ep in endpoints:
            raw = data.get(ep.address)
            if not isinstance(raw, dict):
                out[ep.address] = ScrapeResult(None, f"file: no entry for {ep.address}", at)
                continue
            try:
                out[ep.address] = ScrapeResult({k: float(v) for k, v in raw.items()}, None, at)
            except (TypeError, ValueError) as exc:
                out[ep.address] = ScrapeResult(None, f"file: {ep.address}: {exc}", at)
        return out

    async def close(self) -> None:
        return None


def build_sources(config: Config, scraper: Scraper, with_slo: bool) -> dict[str, TelemetrySource]:
    """One instance per source kind the config uses."""
    kinds = {pool.source(config) for pool in config.pools}
    sources: dict[str, TelemetrySource] = {"scrape": ScrapeSource(scraper, with_slo)}
    if "prometheus" in kinds:
        sources["prometheus"] = PrometheusSource(config, config.telemetry.scrape_timeout)
    if "static" in kinds:
        sources["static"] = StaticSource()
    if "file" in kinds and config.telemetry.file is not None:
        sources["file"] = FileSource(config.telemetry.file)
    return sources
