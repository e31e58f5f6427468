"""Bounds on a telemetry answer before any parsing: decompressed bytes while reading, then
lines and series counted at C speed, so a hostile or broken exporter (a gzip bomb, an endless
body, a page of millions of series) costs at most the limits, never a full parse."""

from __future__ import annotations

import io

import aiohttp

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_SERIES_PER_PAGE = 20_000
LINES_PER_SERIES = 4  # lines of any kind a page may have per allowed series
_READ_CHUNK = 64 * 1024


def refuse_unparsed(text: str, max_series: int) -> str | None:
    """Why a page is too costly to parse, or ``None``. Parse time follows the number of lines,
    so both are bounded: samples (series) to ``max_series``, and every line, comments and
    blank ones included, to :data:`LINES_PER_SERIES` times that (a page of HELP/TYPE pairs
    and samples has at most three lines per series)."""
    max_lines = LINES_PER_SERIES * max_series
    if text.count("\n") > max_lines:
        return (f"series: the endpoint's page has more than {max_lines} lines "
                f"({LINES_PER_SERIES} × telemetry.max_series_per_page); refused without parsing it")
    if series_over(text, max_series):
        return too_many_series(max_series)
    return None


def series_over(text: str, limit: int) -> bool:
    """Whether ``text`` holds more than ``limit`` samples (series), without parsing it.

    Counts lines the way the Prometheus text parser reads them (split on newlines,
    stripped; blank and ``#`` lines are not samples) and stops at the ``limit + 1``-th, so a
    huge page costs at most ``limit`` short line checks. A page with no more lines than
    ``limit`` is decided by one C-speed newline count."""
    if text.count("\n") < limit:
        return False
    count = 0
    for line in io.StringIO(text):
        line = line.strip()
        if line and line[0] != "#":
            count += 1
            if count > limit:
                return True
    return False


class BodyTooLargeError(Exception):
    """A response body (after decompression) grew past its byte limit; reading stopped."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body larger than {limit} bytes")
        self.limit = limit


async def read_limited(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """The response body, read in 64 KiB pieces of *decompressed* bytes; raises
    :class:`BodyTooLargeError` as soon as it exceeds ``max_bytes`` (a gzip bomb or an endless
    body stops there). The session's total timeout bounds the time."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_READ_CHUNK):
        body.extend(chunk)
        if len(body) > max_bytes:
            raise BodyTooLargeError(max_bytes)
    return bytes(body)


def too_many_series(limit: int) -> str:
    """The error of an endpoint whose page is over ``telemetry.max_series_per_page``."""
    return (f"series: the endpoint's page has more than {limit} series "
            f"(telemetry.max_series_per_page); refused without parsing it")
