"""One connected xDS stream as the servicer, the observers and the admin API see it.

`StreamInfo` holds who is on the other end (peer, the node id its first request claimed, the
certificate's identities), the stream's sans-IO machine, and its `Inbox`.

Inbound backpressure: a stream holds at most `INBOX_LIMIT` requests read but not yet handled.
While its `Inbox` is full (the pump is blocked writing to a client that does not read) the
stream stops reading, so gRPC's flow control pushes back on the client instead of requests
piling up in memory.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xds_server.xds.protocol import DeltaStream, SotwStream

if TYPE_CHECKING:
    from xds_server.security.guard import StreamAccess

INBOX_LIMIT = 64  # requests read from a stream and not yet handled


class Inbox:
    """A stream's requests read and not yet handled, at most `limit` of them; then `None`
    once, the end of the stream (which never waits, so it may be one over `limit`)."""

    def __init__(self, limit: int = INBOX_LIMIT) -> None:
        self.limit = limit
        self.max_seen = 0  # the most requests it ever held (the end-of-stream mark not counted)
        self._items: deque = deque()
        self._space = asyncio.Event()

    async def put(self, request: object) -> None:
        """Add `request`, first waiting while the inbox is full."""
        while len(self._items) >= self.limit:
            self._space.clear()
            await self._space.wait()
        self._items.append(request)
        self.max_seen = max(self.max_seen, len(self._items))

    def end(self) -> None:
        self._items.append(None)

    def popleft(self) -> object:
        request = self._items.popleft()
        self._space.set()
        return request

    def __len__(self) -> int:
        return len(self._items)


@dataclass(eq=False)
class StreamInfo:
    """What the admin API and the observers see of a connected stream (hashable by identity:
    observers may key per-stream state on it)."""

    peer: str
    api: str
    service: str
    machine: SotwStream | DeltaStream
    access: StreamAccess | None = None  # set when the servicer has a guard
    wake: asyncio.Event | None = None
    types: set[str] = field(default_factory=set)  # type URLs requested (told to the observers)
    inbox: Inbox = field(default_factory=Inbox)  # requests read, not yet handled

    @property
    def node_id(self) -> str:
        """The node id the stream claimed in its first request (the one it is authorised as)."""
        return self.machine.node.id if self.machine.node is not None else ""

    @property
    def identities(self) -> list[str]:
        """The client certificate's SANs (empty in plaintext, or without a guard)."""
        return list(self.access.identities) if self.access is not None else []
