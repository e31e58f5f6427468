"""Refusals: an HTTP 429 is the server declining the request, not a failure.

A refused request is recorded with its status, the time to the answer (``e2e``), whether the
body is an OpenAI-shaped error (``{"error": {"message": str, "type": str, "code": ...}}``,
what OpenAI clients parse) and the ``Retry-After`` header (raw, and in seconds when it is
delta-seconds or an HTTP date). The same shape check and header are recorded for every
other non-200 answer too, which stays an error (``http_<status>``).
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

REFUSAL_STATUS = 429
MAX_ERROR_BODY = 64 * 1024  # an error body bigger than this is not parsed


@dataclass(frozen=True)
class ErrorAnswer:
    """What a non-200 answer said: OpenAI shape, its ``type`` and ``code``, Retry-After."""

    openai_shaped: bool
    error_type: str | None
    error_code: str | None
    retry_after: str | None
    retry_after_s: float | None


def openai_error(body: bytes) -> tuple[bool, str | None, str | None]:
    """``(shaped, type, code)`` of an error body. Shaped: a JSON object whose ``error`` is an
    object with a non-empty string ``message`` and ``type`` and a ``code`` key (a string, an
    integer or null, as OpenAI's API sends)."""
    if len(body) > MAX_ERROR_BODY:
        return False, None, None
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False, None, None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return False, None, None
    kind, code = err.get("type"), err.get("code")
    code_text = None if code is None else str(code)
    shaped = (isinstance(err.get("message"), str) and bool(err["message"])
              and isinstance(kind, str) and bool(kind) and "code" in err
              and (code is None or isinstance(code, str | int)) and not isinstance(code, bool))
    return shaped, kind if isinstance(kind, str) else None, code_text


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value: delta-seconds (a non-negative number)
    or an HTTP date (RFC 9110 section 10.2.3); None when absent or unreadable."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        return _date_delay(text, time.time() if now is None else now)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _date_delay(text: str, now: float) -> float | None:
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def read_error_answer(body: bytes, headers: Mapping[str, str]) -> ErrorAnswer:
    """Classify a non-200 answer's body and ``Retry-After`` header."""
    shaped, kind, code = openai_error(body)
    raw = headers.get("Retry-After")
    return ErrorAnswer(shaped, kind, code, raw, retry_after_seconds(raw))


def refusal_summary(records: Iterable[Any]) -> dict[str, Any]:
    """Refused requests: count, answer latency (p50/p99 via the caller's percentile), and
    how many were OpenAI-shaped, carried a readable Retry-After, and both."""
    refused = [r for r in records if getattr(r, "refused", False)]
    return {
        "count": len(refused),
        "openai_shaped": sum(bool(r.openai_error) for r in refused),
        "with_retry_after": sum(r.retry_after_s is not None for r in refused),
        "openai_shaped_with_retry_after": sum(bool(r.openai_error)
                                              and r.retry_after_s is not None
                                              for r in refused),
    }
