"""A bounded record of recent NACKs, for `/v1/nacks` and the status page.

Each record names the node id as the stream claimed it (its first request's, the one it was
authorised as), and who sent it: the peer address and, with mTLS, the certificate's
identities. A NACK affects only the stream that sent it, whatever node id it claims.
`NackLog` is a stream observer (`xds.observers`): hand it to the servicer.

Bounded whatever peers send: at most `RECORDS_KEPT` records, each peer string in a record cut
to its bound (the detail to `DETAIL_LIMIT` bytes, saying how long it was), at most
`REJECTED_KEPT` rejected names; so `/v1/nacks` stays under about 4 MB even when every record
is at every bound with characters JSON escapes (`tests/xds/test_peer_bounds.py`)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from xds_server.xds import type_urls
from xds_server.xds.machine.bounds import bounded_text
from xds_server.xds.observers.base import StreamObserver
from xds_server.xds.protocol import Event, Nack
from xds_server.xds.stream_info import StreamInfo

DETAIL_LIMIT = 4096  # UTF-8 bytes of a NACK's text kept (they embed the whole resource)
NODE_LIMIT = 1024  # UTF-8 bytes of the node id kept (the xDS port accepts no longer one)
IDENTITY_LIMIT = 256  # UTF-8 bytes of each certificate identity kept
IDENTITIES_KEPT = 4  # certificate identities kept per record
PEER_LIMIT = 256  # UTF-8 bytes of the peer address kept
REJECTED_KEPT = 16  # rejected resources named per record (`rejected_count` counts them all)
RECORDS_KEPT = 100  # records kept


@dataclass(frozen=True)
class NackRecord:
    """One NACK as kept: every peer string within its bound, whatever the peer sent."""

    at: float
    node: str  # as claimed by the stream's first request
    peer: str
    identities: list[str]  # the client certificate's SANs; [] in plaintext
    api: str
    type: str
    nonce: str
    rejected: dict[str, str]  # the first REJECTED_KEPT, in the order the response carried them
    rejected_count: int
    detail: str


class NackLog(StreamObserver):
    """The last `limit` NACKs, newest first in `recent()`; `total` counts them all. Each record
    is bounded (`NackRecord`), so the log, and `/v1/nacks`, are bounded in bytes."""

    def __init__(self, limit: int = RECORDS_KEPT, clock: Callable[[], float] = time.time) -> None:
        self._records: deque[NackRecord] = deque(maxlen=limit)
        self._clock = clock
        self.total = 0

    def observe(self, info: StreamInfo, event: Event) -> None:
        if not isinstance(event, Nack):
            return
        self.total += 1
        self._records.append(_record(self._clock(), info, event))

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        self.observe(stream, event)

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(record) for record in reversed(self._records)]


def _record(at: float, info: StreamInfo, event: Nack) -> NackRecord:
    identities = [bounded_text(identity, IDENTITY_LIMIT)
                  for identity in info.identities[:IDENTITIES_KEPT]]
    rejected = dict(itertools.islice(event.rejected.items(), REJECTED_KEPT))
    return NackRecord(
        at=at, node=bounded_text(info.node_id, NODE_LIMIT),
        peer=bounded_text(info.peer, PEER_LIMIT), identities=identities, api=info.api,
        type=type_urls.short_name(event.type_url), nonce=bounded_text(event.nonce, 64),
        rejected=rejected, rejected_count=len(event.rejected),
        detail=bounded_text(event.detail, DETAIL_LIMIT))
