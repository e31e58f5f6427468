"""Peer-supplied text as it may appear in a log line: quoted and escaped like `repr` (no
newline, control or other non-printable character of the peer's survives, so a peer cannot
forge or split lines) and cut to a bounded length, saying how much was left out."""

from __future__ import annotations

from xds_server.xds import type_urls

SHOWN_CHARS = 256  # characters of one peer string in a log line (node ids, type URLs)


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted and escaped, at most `limit` of its characters, then how many more."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text) - limit} more characters)"


def type_name(type_url: str) -> str:
    """A type's short name (`eds`) when this server serves it, else the type URL as the peer
    sent it, shown escaped and cut."""
    return type_urls.SHORT_NAMES.get(type_url) or shown(type_url, 100)
