"""What the machines return: events from `receive()`, responses and `Withheld` notices from
`responses()`. Plain frozen values; the transport hands them to the stream observers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xds_server.xds.snapshot import Resource


@dataclass(frozen=True)
class Ack:
    type_url: str
    nonce: str
    version: str


@dataclass(frozen=True)
class Nack:
    type_url: str
    nonce: str
    version: str
    detail: str
    rejected: Mapping[str, str]  # resource name -> version we sent and the client refused


@dataclass(frozen=True)
class StaleNonce:
    type_url: str
    nonce: str


@dataclass(frozen=True)
class Subscription:
    type_url: str
    wildcard: bool
    names: frozenset[str]


Event = Ack | Nack | StaleNonce | Subscription


@dataclass(frozen=True)
class Withheld:
    """Our fault: resources not sent because they cannot fit in one response. `names` is every
    resource of a SotW whole-state type, or the one resource that alone is too large."""

    type_url: str
    version: str
    names: tuple[str, ...]
    size: int  # bytes they need
    limit: int  # bytes a response may carry


@dataclass(frozen=True)
class Response:
    """A response to send. `resources` are shared snapshot objects; `removed` is Delta only."""

    type_url: str
    version: str
    nonce: str
    resources: tuple[Resource, ...]
    removed: tuple[str, ...] = ()
