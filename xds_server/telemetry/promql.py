"""Read endpoint signals from a Prometheus server instead of scraping every endpoint.

One :class:`PromQLSource` runs one instant query (``/api/v1/query``) per signal per tick,
all concurrently, and maps each result series to an endpoint address through one label
(``instance`` by default, i.e. the ``host:port`` Prometheus scraped). A failing query only
loses its own signal: the error is reported per signal in :class:`PromQLResult.errors`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp

from xds_server.telemetry.bounds import DEFAULT_MAX_BODY_BYTES, BodyTooLargeError, read_limited
from xds_server.telemetry.redirects import is_redirect, redirect_refused
from xds_server.telemetry.worker import off_loop

DEFAULT_TIMEOUT_SECONDS = 2.0
DEFAULT_RATE_WINDOW = "1m"


def default_queries(
    label: str = "instance", rate_window: str = DEFAULT_RATE_WINDOW
) -> dict[str, str]:
    """Default signal -> PromQL map for vLLM plus DCGM, aggregated ``by (label)``.

    ``itl_ms`` is the mean inter-token latency over ``rate_window``; while an endpoint has
    no traffic its series is filtered out (``> 0``) rather than answered as NaN, so an idle
    endpoint is not flagged for a rejected value. ``gpu_mem_pct`` assumes the DCGM series carry the
    same ``label`` value as the model server (e.g. a per-pod ``pod`` label, or an exporter
    scraped under the model server's ``instance``); otherwise override it, for example with
    ``label_replace``.
    """
    by = f"by ({label})"
    itl = "vllm:inter_token_latency_seconds"
    return {
        "kv_usage": f"max {by} (vllm:kv_cache_usage_perc)",
        "queue": f"sum {by} (vllm:num_requests_waiting)",
        "running": f"sum {by} (vllm:num_requests_running)",
        "itl_ms": (
            f"1000 * sum {by} (rate({itl}_sum[{rate_window}]))"
            f" / (sum {by} (rate({itl}_count[{rate_window}])) > 0)"
        ),
        "gpu_mem_pct": (
            f"max {by} (100 * DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE))"
        ),
    }


class PromQLError(Exception):
    """A query's answer could not be used (``str(exc)`` is ``"<kind>: <detail>"``)."""


@dataclass(frozen=True)
class PromQLResult:
    """One tick of queries.

    ``values`` maps endpoint address -> signal -> value (only addresses with at least one
    value appear); ``errors`` maps each failed signal to ``"<kind>: <detail>"`` (kinds:
    ``connect``, ``timeout``, ``http``, ``redirect`` (never followed), ``size``,
    ``prometheus``, ``format``); ``problems`` lists
    series that were skipped (missing label, non-finite value, duplicate address), and
    ``endpoint_problems`` those of them that name an endpoint, by its address.
    """

    values: dict[str, dict[str, float]]
    errors: dict[str, str] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    endpoint_problems: dict[str, list[str]] = field(default_factory=dict)


class Vector(NamedTuple):
    """A parsed instant vector: ``label value -> value``, every problem, and the problems
    that name a label value (a non-finite value, a duplicate), by that value."""

    values: dict[str, float]
    problems: list[str]
    by_key: dict[str, list[str]]


def _series_value(series: Any) -> float:
    try:
        return float(series["value"][1])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PromQLError(f"format: bad sample {series!r}") from exc


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (if enabled) for the duration of the block.

    A 10,000-series answer decodes to ~20,000 containers, which would set off collections
    (full ones included) that walk the whole, acyclic tree several times per answer: about
    a third of the parse time. Reference counting frees the tree before the GC resumes.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _answer(body: bytes | str) -> Mapping[str, Any]:
    """The ``data`` of a successful API answer; raises :class:`PromQLError` otherwise."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PromQLError(f"format: answer is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise PromQLError("format: answer is not a JSON object")
    if doc.get("status") != "success":
        kind, detail = doc.get("errorType", "unknown"), doc.get("error", "no error text")
        raise PromQLError(f"prometheus: {kind}: {detail}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        kind = data.get("resultType") if isinstance(data, dict) else None
        raise PromQLError(f"format: expected an instant vector, got resultType={kind!r}")
    if not isinstance(data.get("result"), list):
        raise PromQLError("format: data.result is not a list")
    return data


def _metric(series: Any) -> Any:
    return series.get("metric", {}) if isinstance(series, dict) else {}


def _slow_series(series: Any, label: str) -> tuple[Any, float]:
    """``(label value or None, value)`` of a series not of the plain shape; raises
    :class:`PromQLError` if it has no usable sample."""
    key = _metric(series).get(label)
    return key, _series_value(series)


def parse_vector(body: bytes | str, label: str) -> Vector:
    """Parse an ``/api/v1/query`` answer into ``label value -> float``, plus problems.

    Series without ``label`` or with a non-finite value are skipped; if two series share a
    label value the larger value is kept (and reported). Raises :class:`PromQLError` for an
    error answer, a non-vector result or malformed JSON.
    """
    with _gc_paused():
        return _parse_vector(body, label)


def _parse_vector(body: bytes | str, label: str) -> Vector:
    values: dict[str, float] = {}
    problems: list[str] = []
    by_key: dict[str, list[str]] = {}
    isfinite = math.isfinite
    for series in _answer(body)["result"]:
        try:  # the plain shape: {"metric": {label: key, ...}, "value": [time, "number"]}
            key = series["metric"][label]
            value = float(series["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            key, value = _slow_series(series, label)
        if key is None:
            problems.append(f"series {_metric(series)} has no {label!r} label")
        elif not isfinite(value):
            _problem(problems, by_key, key, f"{label}={key!r} is {value!r}")
        elif key in values:
            _problem(problems, by_key, key, f"{label}={key!r} appears twice; kept the larger value")
            values[key] = max(values[key], value)
        else:
            values[key] = value
    return Vector(values, problems, by_key)


def _problem(problems: list[str], by_key: dict[str, list[str]], key: Any, text: str) -> None:
    problems.append(text)
    by_key.setdefault(str(key), []).append(text)


Answer = Vector | str  # parse_vector output, or an error


def merge_answers(
    answers: Mapping[str, Answer], address_of: Mapping[str, str] | None = None
) -> PromQLResult:
    """Combine per-signal answers (``parse_vector`` output or an error string) into one
    :class:`PromQLResult`, mapping label values to addresses through ``address_of``."""
    values: dict[str, dict[str, float]] = {}
    errors: dict[str, str] = {}
    problems: list[str] = []
    endpoint_problems: dict[str, list[str]] = {}
    for signal, answer in answers.items():
        if isinstance(answer, str):
            errors[signal] = answer
            continue
        per_label, found, by_key = answer
        problems += [f"{signal}: {p}" for p in found]
        for key, texts in by_key.items():
            address = key if address_of is None else address_of.get(key)
            if address is not None:
                endpoint_problems.setdefault(address, []).extend(f"{signal}: {t}" for t in texts)
        if address_of is not None:
            mapped = ((address_of.get(k), v) for k, v in per_label.items())
            per_label = {a: v for a, v in mapped if a is not None}
        for address, value in per_label.items():
            row = values.get(address)
            if row is None:
                values[address] = {signal: value}
            else:
                row[signal] = value
    return PromQLResult(values=values, errors=errors, problems=tuple(problems),
                        endpoint_problems=endpoint_problems)


class PromQLSource:
    """Runs one instant query per signal against a Prometheus server, concurrently.

    ``queries`` maps our signal names (``kv_usage``, ``queue``, ``itl_ms``...) to PromQL;
    each query should return one series per endpoint carrying ``label``. ``address_of``
    maps label values to endpoint addresses; label values it does not list are ignored.
    Without it the label value *is* the address. The HTTP session is created lazily inside
    the running loop; call :meth:`close` when done. Use from a single event loop.

    Every answer is bounded like a scraped page: ``timeout_seconds`` for the whole request,
    body included, and ``max_body_bytes`` of decompressed body (reading stops there and the
    query fails with a ``size`` error). JSON decoding and merging run on the telemetry worker
    thread, never on the event loop. A redirect is never followed: the query fails with a
    ``redirect`` error.
    """

    def __init__(
        self,
        base_url: str,
        *,
        label: str = "instance",
        queries: Mapping[str, str] | None = None,
        address_of: Mapping[str, str] | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self._max_body_bytes = max_body_bytes
        self.url = base_url.rstrip("/") + "/api/v1/query"
        self.label = label
        self.queries = dict(queries) if queries is not None else default_queries(label)
        if not self.queries:
            raise ValueError("queries must not be empty")
        self.address_of = dict(address_of) if address_of is not None else None
        self._timeout_seconds = timeout_seconds
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session (a later :meth:`fetch` opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self) -> PromQLResult:
        """Run every query once; a failed query only fails its own signal."""
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self._timeout_seconds)
            self._session = aiohttp.ClientSession(timeout=timeout)
        signals = sorted(self.queries)
        answers = await asyncio.gather(*(self._query(self._session, s) for s in signals))
        return await off_loop(merge_answers, dict(zip(signals, answers, strict=True)),
                              self.address_of)

    async def _query(self, session: aiohttp.ClientSession, signal: str) -> Answer:
        """The parsed answer, or an ``"<kind>: <detail>"`` error string."""
        try:
            async with session.get(self.url, params={"query": self.queries[signal]},
                                   allow_redirects=False) as resp:
                if is_redirect(resp.status):
                    return f"redirect: {redirect_refused('Prometheus', resp.status, resp.headers)}"
                status, reason = resp.status, resp.reason
                body = await read_limited(resp, self._max_body_bytes)
        except BodyTooLargeError as exc:
            return (f"size: Prometheus answer larger than {exc.limit} bytes (decompressed); "
                    f"stopped reading, query not used")
        except (TimeoutError, aiohttp.ServerTimeoutError):
            return f"timeout: no answer within {self._timeout_seconds:g}s"
        except aiohttp.ClientConnectionError as exc:
            return f"connect: {type(exc).__name__}: {exc}"
        except aiohttp.ClientError as exc:
            return f"http: {type(exc).__name__}: {exc}"
        return await off_loop(_interpret, body, self.label, status, reason)


def _interpret(body: bytes, label: str, status: int, reason: str | None) -> Answer:
    """An answer's :class:`Vector`, or its error string (CPU work: run off the loop)."""
    try:
        parsed = parse_vector(body, label)
    except PromQLError as exc:
        return str(exc) if status == 200 else f"http: status {status} {reason}; {exc}"
    if status != 200:
        return f"http: status {status} {reason or ''}".rstrip()
    return parsed
