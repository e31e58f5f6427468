"""JSON for the admin documents, encoded in small pieces and assembled from pre-encoded
fragments, within a byte budget. Pure: no I/O, no threads.

Each piece is one ``json.dumps`` call of a small value (an endpoint, a stream, a NACK record),
so the thread that encodes a large document gives the GIL back between pieces and the event
loop keeps serving; the pieces' dicts die as soon as they are encoded (few objects for the
cyclic collector to walk)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MIB = 1024 * 1024


def dumps(value: Any) -> bytes:
    """One value as compact, key-sorted UTF-8 JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def join_object(pairs: Iterable[tuple[str, bytes]]) -> bytes:
    """A JSON object from (key, pre-encoded value) pairs, in the order given."""
    return b"{" + b",".join(dumps(key) + b":" + value for key, value in pairs) + b"}"


def join_array(items: Iterable[bytes]) -> bytes:
    """A JSON array of pre-encoded items, in the order given."""
    return b"[" + b",".join(items) + b"]"


@dataclass(frozen=True)
class Within:
    """The leading fragments that fit a budget, and how many of the rest were left out."""

    kept: list[bytes]
    left_out: int


def within_budget(fragments: Sequence[bytes], budget: int) -> Within:
    """The leading ``fragments`` whose sum (with a separator byte each) fits ``budget``."""
    used = 0
    for index, fragment in enumerate(fragments):
        used += len(fragment) + 1
        if used > budget:
            return Within(list(fragments[:index]), len(fragments) - index)
    return Within(list(fragments), 0)


@dataclass(frozen=True)
class TooLarge:
    """A document over its byte limit: never sent; the 413 says how to ask for less."""

    document: str
    size: int
    limit: int
    hint: str

    @property
    def message(self) -> str:
        return (f"the {self.document} document is {self.size} bytes, over its limit of "
                f"{self.limit} bytes; {self.hint}")


Encoded = bytes | TooLarge


@dataclass(frozen=True)
class DocumentLimits:
    """The most bytes each admin document may be; over it, the reader gets a 413 that says
    how to ask for less (`/v1/weights`, `/v1/config`), or the newest entries that fit and a
    count of the rest (`/v1/snapshot`, `/v1/nacks`, `/v1/history`). A 10,000-endpoint
    fleet's `/v1/weights` is about 5.4 MiB."""

    weights_bytes: int = 32 * MIB
    snapshot_bytes: int = 32 * MIB
    config_bytes: int = 16 * MIB
    nacks_bytes: int = 8 * MIB
    rollouts_bytes: int = 1 * MIB
    history_bytes: int = 8 * MIB
    admission_bytes: int = 8 * MIB


def bounded(document: str, body: bytes, limit: int, hint: str) -> Encoded:
    """``body``, or :class:`TooLarge` when it is over ``limit`` bytes."""
    return body if len(body) <= limit else TooLarge(document, len(body), limit, hint)
