"""A bounded record of recent NACKs, for `/v1/nacks` and the status page.

Each record names the node id as the stream claimed it (its first request's, the one it was
authorised as), and who sent it: the peer address and, with mTLS, the certificate's
identities. A NACK affects only the stream that sent it, whatever node id it claims.
`NackLog` is a stream observer (`xds.observers`): hand it to the servicer."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from xds_server.xds import type_urls
from xds_server.xds.observers.base import StreamObserver
from xds_server.xds.protocol import Event, Nack
from xds_server.xds.stream_info import StreamInfo

DETAIL_LIMIT = 4000  # NACK texts embed the whole resource; keep the head


@dataclass(frozen=True)
class NackRecord:
    at: float
    node: str  # as claimed by the stream's first request
    peer: str
    identities: list[str]  # the client certificate's SANs; [] in plaintext
    api: str
    type: str
    nonce: str
    rejected: dict[str, str]
    detail: str


class NackLog(StreamObserver):
    """The last `limit` NACKs, newest first in `recent()`; `total` counts them all."""

    def __init__(self, limit: int = 100, clock: Callable[[], float] = time.time) -> None:
        self._records: deque[NackRecord] = deque(maxlen=limit)
        self._clock = clock
        self.total = 0

    def observe(self, info: StreamInfo, event: Event) -> None:
        if not isinstance(event, Nack):
            return
        self.total += 1
        self._records.append(NackRecord(
            at=self._clock(), node=info.node_id, peer=info.peer, identities=info.identities,
            api=info.api,
            type=type_urls.short_name(event.type_url), nonce=event.nonce,
            rejected=dict(event.rejected), detail=event.detail[:DETAIL_LIMIT]))

    def on_event(self, stream: StreamInfo, event: Event) -> None:
        self.observe(stream, event)

    def recent(self) -> list[dict[str, Any]]:
        return [asdict(record) for record in reversed(self._records)]
