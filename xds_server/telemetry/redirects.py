"""Redirects are never followed: a metrics page or Prometheus that answers 3xx is that
endpoint's fault, and the answer is unread. Following one would let an endpoint make trimtab
fetch any URL it names (an internal service, another endpoint's page) every tick and use it
as its own signals."""

from __future__ import annotations

from collections.abc import Mapping

MAX_SHOWN_LOCATION_CHARS = 200  # of a peer's Location header in an error or a log line


def is_redirect(status: int) -> bool:
    """A 3xx answer: aiohttp would follow it unless told not to."""
    return 300 <= status < 400


def shown_location(headers: Mapping[str, str]) -> str:
    """The peer's ``Location`` header as it may appear in a log line: at most
    MAX_SHOWN_LOCATION_CHARS characters, every control or non-printable character escaped
    (``repr`` style), ``(none)`` when absent."""
    location = headers.get("Location")
    if location is None:
        return "(none)"
    shown = repr(location[:MAX_SHOWN_LOCATION_CHARS])[1:-1]
    if len(location) > MAX_SHOWN_LOCATION_CHARS:
        shown += f"... ({len(location)} characters)"
    return shown


def redirect_refused(what: str, status: int, headers: Mapping[str, str]) -> str:
    """The error detail for a refused redirect, e.g. ``metrics page answered 302 redirect
    to http://...; trimtab does not follow redirects``."""
    return (f"{what} answered {status} redirect to {shown_location(headers)}; "
            f"trimtab does not follow redirects")
