"""The telemetry sources a config needs, kept across config changes where their settings did
not change (a discovery change keeps HTTP sessions and held DCGM reads), and the replaced
ones closed in the background, never on the caller's path."""

from __future__ import annotations

import asyncio
import logging

from xds_server.config.schema import Config
from xds_server.telemetry.scrape import Scraper
from xds_server.telemetry.sources import TelemetrySource, build_sources

log = logging.getLogger("trimtab.controller")


def needs_slo(config: Config) -> bool:
    """Canary gates and the autoscaler read latency histograms; plain weighting does not."""
    return config.keda.address is not None or any(
        pool.versions is not None or pool.scaling is not None for pool in config.pools)


class SourceSet:
    def __init__(self) -> None:
        self.sources: dict[str, TelemetrySource] = {}
        self._retired: list[TelemetrySource | Scraper] = []  # replaced, to be closed
        self._closing: set[asyncio.Task[None]] = set()

    def apply(self, old: Config | None, config: Config, scraper: Scraper) -> None:
        """The sources ``config`` needs, reusing every current one whose settings match;
        the others are retired and closed in the background."""
        fresh = build_sources(config, scraper, needs_slo(config))
        same = old is not None and old.telemetry == config.telemetry \
            and needs_slo(old) == needs_slo(config)
        kept: dict[str, TelemetrySource] = {}
        for kind, source in fresh.items():
            current = self.sources.get(kind)
            if same and current is not None and getattr(current, "scraper", scraper) is scraper:
                kept[kind] = current
            else:
                kept[kind] = source
        for kind, source in self.sources.items():
            if kept.get(kind) is not source and kind != "scrape":  # scrape: the shared scraper
                self._retired.append(source)
        self.sources = kept
        self._schedule_close()

    def retire(self, thing: TelemetrySource | Scraper) -> None:
        self._retired.append(thing)

    def _schedule_close(self) -> None:
        """Close retired sources in the background (apply runs in sync callbacks)."""
        if not self._retired:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: close_retired() or close() closes them
            return
        task = loop.create_task(self.close_retired())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close_retired(self) -> None:
        retired, self._retired = self._retired, []
        for source in retired:
            try:
                await source.close()
            except Exception:  # noqa: BLE001 - one failing close must not keep the others open
                log.exception("closing a retired telemetry source failed")

    async def close(self, own_scraper: bool) -> None:
        """Close every source (the shared scraper's only when it is ours) and the retired."""
        for kind, source in self.sources.items():
            if kind != "scrape" or own_scraper:
                await source.close()
        await self.close_retired()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
