"""Scrape metrics pages (bounded by :mod:`.bounds`, parsed off the loop by :mod:`.parsers`)
; the worker thread that parses them is :mod:`.worker`, and the store of the latest
observation per endpoint :mod:`.store`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from xds_server.telemetry.bounds import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_SERIES_PER_PAGE,
    BodyTooLargeError,
    read_limited,
    refuse_unparsed,
)
from xds_server.telemetry.parsers.page import page_signals
from xds_server.telemetry.reading import HistogramState, SloCounters
from xds_server.telemetry.redirects import is_redirect, redirect_refused
from xds_server.telemetry.worker import off_loop


@dataclass(frozen=True)
class ScrapeResult:
    """Outcome of scraping one endpoint: signals on success, ``"<kind>: <detail>"`` on error.

    ``problems`` lists inputs that were present but rejected (NaN, negative, out of range)
    or that partly failed (the node's DCGM page): the read still counts, the endpoint is
    flagged, and a rejected value is never among ``signals``.
    """

    signals: dict[str, float] | None
    error: str | None
    collected_at: float
    problems: tuple[str, ...] = ()
    slo: SloCounters | None = None  # the canary gates' counters, when a rollout reads them
    itl: HistogramState | None = None  # the cumulative ITL histogram, when the page has one


@dataclass(frozen=True)
class ParsedPage:
    """What a page parser may return instead of a plain ``dict``: signals and problems."""

    signals: dict[str, float]
    problems: tuple[str, ...] = ()
    slo: SloCounters | None = None
    itl: HistogramState | None = None


PageParser = Callable[[str], "dict[str, float] | ParsedPage"]


class Scraper:
    """Scrapes many metrics URLs concurrently with a per-request timeout.

    Every page is bounded in time (``timeout_seconds``), bytes (``max_body_bytes``, after
    decompression) and series (``max_series_per_page``, counted before any parsing: a page
    over it is refused unparsed). A redirect is never followed: the endpoint is unread, with a
    ``redirect`` error (:mod:`.redirects`). Decoding and parsing run on the telemetry worker thread
    (:func:`off_loop`), never on the event loop. One ``aiohttp.ClientSession`` is created lazily on first use (inside the running loop)
    and reused; call :meth:`close` when done. Use a Scraper from a single event loop.
    """

    def __init__(
        self,
        timeout_seconds: float,
        max_concurrency: int = 64,
        parse: PageParser = page_signals,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_series_per_page: int = DEFAULT_MAX_SERIES_PER_PAGE,
    ) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_series_per_page < 1:
            raise ValueError(f"max_series_per_page must be >= 1, got {max_series_per_page}")
        self._max_series = max_series_per_page
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        self._timeout_seconds = timeout_seconds
        self._max_concurrency = max_concurrency
        self._parse = parse
        self._max_body_bytes = max_body_bytes
        self._semaphore: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None

    def _ensure_session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_concurrency)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self._max_concurrency)
        return self._session, self._semaphore

    async def close(self) -> None:
        """Close the shared HTTP session (a later scrape opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(
        self, targets: Mapping[str, str], now: Callable[[], float],
        parse: PageParser | None = None,
    ) -> dict[str, ScrapeResult]:
        """Scrape every ``address -> metrics_url`` target; failures stay per endpoint.
        ``parse`` overrides the scraper's page parser for this call."""
        if not targets:
            return {}
        session, semaphore = self._ensure_session()
        addresses = sorted(targets)
        parser = parse or self._parse
        results = await asyncio.gather(
            *(self._scrape_one(session, semaphore, targets[a], now, parser) for a in addresses)
        )
        return dict(zip(addresses, results, strict=True))

    async def _scrape_one(
        self,
        session: aiohttp.ClientSession,
        semaphore: asyncio.Semaphore,
        url: str,
        now: Callable[[], float],
        parse: PageParser,
    ) -> ScrapeResult:
        async with semaphore:
            try:
                body = await self._fetch(session, url)
            except (TimeoutError, aiohttp.ServerTimeoutError):
                detail = f"no complete answer within {self._timeout_seconds:g}s"
                return ScrapeResult(None, f"timeout: {detail}", now())
            except aiohttp.ClientConnectionError as exc:
                return ScrapeResult(None, f"connect: {_describe(exc)}", now())
            except _FetchError as exc:
                return ScrapeResult(None, f"{exc.kind}: {exc.detail}", now())
            except aiohttp.ClientError as exc:
                return ScrapeResult(None, f"fetch: {_describe(exc)}", now())
            collected_at = now()
        return await off_loop(self.parse_body, body, parse, collected_at)

    def parse_body(self, body: bytes, parse: PageParser, collected_at: float) -> ScrapeResult:
        """Decode, bound and parse one page (CPU work: :meth:`scrape` runs it off the loop)."""
        try:
            text = body.decode("utf-8")
            refused = refuse_unparsed(text, self._max_series)
            if refused is not None:
                return ScrapeResult(None, refused, collected_at)
            parsed = parse(text)
        except Exception as exc:  # a bad page must only fail this endpoint
            return ScrapeResult(None, f"parse: {_describe(exc)}", collected_at)
        if isinstance(parsed, ParsedPage):
            return ScrapeResult(parsed.signals, None, collected_at, parsed.problems, parsed.slo,
                                parsed.itl)
        return ScrapeResult(parsed, None, collected_at)

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> bytes:
        async with session.get(url, headers={"Accept": "text/plain"},
                               allow_redirects=False) as resp:
            if is_redirect(resp.status):
                raise _FetchError("redirect",
                                  redirect_refused("metrics page", resp.status, resp.headers))
            if resp.status != 200:
                raise _FetchError("http", f"status {resp.status} {resp.reason or ''}".rstrip())
            try:
                return await read_limited(resp, self._max_body_bytes)
            except BodyTooLargeError as exc:
                raise _FetchError("size", str(exc)) from None


class _FetchError(Exception):
    """A metrics endpoint answered, but not with a usable body."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# Load signals a policy mixes: when a read rejects one the server reports (a problem line
# "<name>: ..."), the store holds its last good value, then counts it saturated.
