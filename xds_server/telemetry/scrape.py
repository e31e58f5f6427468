"""Scrape metrics pages (bounded by :mod:`.bounds`, parsed off the loop by :mod:`.parsers`)
and keep the latest observation per endpoint (:class:`TelemetryStore`)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import aiohttp

from weight_calculator.types import Observation, Sample
from xds_server.telemetry.bounds import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_SERIES_PER_PAGE,
    BodyTooLargeError,
    read_limited,
    refuse_unparsed,
)
from xds_server.telemetry.parsers.page import page_signals
from xds_server.telemetry.reading import SloCounters

P = ParamSpec("P")
T = TypeVar("T")
_worker: tuple[int, ThreadPoolExecutor] | None = None  # (creating pid, executor)
_worker_lock = threading.Lock()


def telemetry_worker() -> ThreadPoolExecutor:
    """The one thread that runs telemetry CPU work (page parsing, weighing) for the process.

    One thread, not a pool: pure-Python work holds the GIL, so a second worker would add no
    throughput and would make the event loop wait behind more threads for the GIL. A forked
    child gets its own (the parent's thread does not exist there)."""
    global _worker
    with _worker_lock:
        if _worker is None or _worker[0] != os.getpid():
            _worker = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="trimtab-telemetry"))
        return _worker[1]


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run ``fn`` on the telemetry worker thread and await its result: CPU work there never
    holds up the event loop that serves xDS, admin, health and KEDA. ``fn`` must not touch
    state that the loop mutates meanwhile (pass it what it needs).

    The cyclic garbage collector is paused while ``fn`` runs: a collection holds the GIL
    whichever thread runs it, so the loop would wait for every one that ``fn``'s allocations
    set off (several full ones per tick at 10,000 endpoints, each walking ``fn``'s
    short-lived objects too). Reference counting still frees them as ``fn`` drops them; the
    collector runs once ``fn`` is done, over what is left."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(telemetry_worker(), _without_gc, fn, args, kwargs)


def _without_gc(fn: Callable[..., T], args: tuple[object, ...], kwargs: dict[str, object]) -> T:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()


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


@dataclass(frozen=True)
class ParsedPage:
    """What a page parser may return instead of a plain ``dict``: signals and problems."""

    signals: dict[str, float]
    problems: tuple[str, ...] = ()
    slo: SloCounters | None = None


PageParser = Callable[[str], "dict[str, float] | ParsedPage"]


class Scraper:
    """Scrapes many metrics URLs concurrently with a per-request timeout.

    Every page is bounded in time (``timeout_seconds``), bytes (``max_body_bytes``, after
    decompression) and series (``max_series_per_page``, counted before any parsing: a page
    over it is refused unparsed). Decoding and parsing run on the telemetry worker thread
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
            return ScrapeResult(parsed.signals, None, collected_at, parsed.problems, parsed.slo)
        return ScrapeResult(parsed, None, collected_at)

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> bytes:
        async with session.get(url, headers={"Accept": "text/plain"}) as resp:
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
LOAD_SIGNALS = ("kv_usage", "gpu_mem_pct", "queue", "itl_ms")
_REJECTED_AS = {"itl": "itl_ms"}  # the ITL histogram feeds itl_ms


def rejected_load_signals(problems: Iterable[str], signals: Mapping[str, float]
                          ) -> tuple[str, ...]:
    """Load signals named by ``problems`` (``"<signal>: ..."``) and absent from ``signals``."""
    found: list[str] = []
    for line in problems:
        head = line.split(":", 1)[0].strip()
        name = _REJECTED_AS.get(head, head)
        if name in LOAD_SIGNALS and name not in signals and name not in found:
            if name == "itl_ms" and "itl_sum" in signals:
                continue
            found.append(name)
    return tuple(found)


# One endpoint's latest state in the store, as a tuple of atomic values and tuples of them:
# (collected_at, signals as (name, value) pairs, problems, saturated) of the last good sample
# (None, None, (), () when there is none), then the latest error and failures in a row. The
# cyclic GC untracks such a tuple (not one that holds a dict, even an untracked one), so
# 10,000 endpoints add nothing to what each full collection walks; an Observation and its
# Sample would be two tracked objects per endpoint.
Row = tuple[float | None, tuple[tuple[str, float], ...] | None, tuple[str, ...], tuple[str, ...],
            str | None, int]
_NO_ROW: Row = (None, None, (), (), None, 0)


@dataclass(frozen=True)
class ObservationRows:
    """The store's rows for some addresses, copied on the loop (immutable rows, new dicts):
    :meth:`observations` builds the :class:`Observation` objects where they are used."""

    rows: dict[str, Row]
    first_seen: dict[str, float]

    def observations(self) -> dict[str, Observation]:
        return {a: _observation(row, self.first_seen.get(a)) for a, row in self.rows.items()}


def _observation(row: Row, first_seen: float | None) -> Observation:
    at, signals, problems, saturated, error, failures = row
    sample = None if at is None or signals is None else Sample(at, dict(signals), problems,
                                                               saturated)
    return Observation(sample, error, first_seen, failures)


class TelemetryStore:
    """The latest :class:`Observation` per endpoint address, and when each was first seen.

    A load signal that a read rejects (NaN, negative, out of range: named in its problems)
    keeps its last good value for up to ``hold_seconds``, then counts as saturated (in
    ``Sample.saturated``) until a read carries it valid again. A signal a server never
    reports is simply absent (the policy renormalises over the rest). Everything is kept in
    forms the cyclic GC does not track (see :data:`Row`).
    """

    def __init__(self, hold_seconds: float = 6.0) -> None:
        self.hold_seconds = hold_seconds
        self._rows: dict[str, Row] = {}
        self._first_seen: dict[str, float] = {}
        # Per address, per load signal: when it was last good, and its value (None for an ITL
        # that a histogram carries). Two dicts of atomic values, not (at, value) tuples: a
        # dict that takes in a fresh tuple is tracked again.
        self._good_at: dict[str, dict[str, float]] = {}
        self._good_value: dict[str, dict[str, float | None]] = {}

    def record(self, address: str, result: ScrapeResult) -> None:
        """Success replaces the sample; failure keeps the last good sample and sets error."""
        self._first_seen.setdefault(address, result.collected_at)
        if result.error is None and result.signals is not None:
            self._rows[address] = self._sample(address, result)
            return
        error = result.error if result.error is not None else "scrape: no signals"
        at, signals, problems, saturated, _, failures = self._rows.get(address, _NO_ROW)
        self._rows[address] = (at, signals, problems, saturated, error, failures + 1)

    def _sample(self, address: str, result: ScrapeResult) -> Row:
        """The read's sample: its signals, a rejected load signal held or marked saturated."""
        signals = dict(result.signals or {})
        at = result.collected_at
        good_at = self._good_at.setdefault(address, {})
        good_value = self._good_value.setdefault(address, {})
        for name in LOAD_SIGNALS:
            if name in signals:
                good_at[name], good_value[name] = at, signals[name]
            elif name == "itl_ms" and "itl_sum" in signals:
                good_at[name], good_value[name] = at, None  # the latency window has it
        problems = list(result.problems)
        saturated: list[str] = []
        for name in rejected_load_signals(result.problems, signals):
            last_at = good_at.get(name)
            if last_at is not None and at - last_at <= self.hold_seconds:
                last = good_value[name]
                if last is not None:
                    signals[name] = last
                problems.append(f"{name}: holding the last good value for at most "
                                f"{self.hold_seconds:g}s")
            else:
                saturated.append(name)
                problems.append(f"{name}: counted as saturated until it is valid again")
        return (at, tuple(signals.items()), tuple(problems), tuple(saturated), None, 0)

    def seen(self, addresses: Iterable[str], at: float) -> None:
        """Note ``at`` as the first-seen time of every address not seen before."""
        for address in addresses:
            self._first_seen.setdefault(address, at)

    def rows(self, addresses: Iterable[str]) -> ObservationRows:
        """A copy of what the store holds for ``addresses``, cheap to take on the loop."""
        rows, first_seen = self._rows, self._first_seen
        wanted = list(addresses)
        return ObservationRows({a: rows.get(a, _NO_ROW) for a in wanted},
                               {a: first_seen[a] for a in wanted if a in first_seen})

    def observations(self, addresses: Iterable[str]) -> dict[str, Observation]:
        """Observations for ``addresses`` (never-read ones get ``Observation(None)``, with
        their first-seen time when :meth:`seen` noted one)."""
        return self.rows(addresses).observations()

    def forget(self, keep: set[str]) -> None:
        """Drop every endpoint not in ``keep``."""
        for table in (self._rows, self._first_seen, self._good_at, self._good_value):
            for address in [a for a in table if a not in keep]:
                del table[address]
