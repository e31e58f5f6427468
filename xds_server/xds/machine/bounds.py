"""The bounds on what a peer writes into a request, checked before the machine keeps any of
it: each string field's UTF-8 size (`FieldLimits`), and the node's. A field over its bound
ends the stream (`FieldTooLarge`, the peer's fault) with a message naming the field, its size
and the bound; a NACK's error text is the exception, kept truncated (`bounded_text`)."""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2

from xds_server.xds.machine.limits import FieldLimits, FieldTooLarge

_MAX_UTF8 = 4  # bytes one code point takes at most in UTF-8


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _fits(text: str, limit: int) -> bool:
    """Whether `text` is at most `limit` UTF-8 bytes (encoding it only when the length in
    code points cannot tell)."""
    if len(text) * _MAX_UTF8 <= limit:
        return True
    return len(text) <= limit and utf8_size(text) <= limit


def refuse(field: str, size: int, limit: int) -> FieldTooLarge:
    return FieldTooLarge(f"{field} is {size} bytes; this server accepts at most {limit} "
                         f"(the xDS port's bound on {field}, docs/security.md)")


def check_text(field: str, text: str, limit: int) -> None:
    """Refuse `text` if it is over `limit` UTF-8 bytes."""
    if not _fits(text, limit):
        raise refuse(field, utf8_size(text), limit)


def check_each(field: str, texts: Iterable[str], limit: int) -> None:
    """Refuse the first of `texts` over `limit` bytes (one pass at C speed when none can be)."""
    texts = list(texts)
    if max(map(len, texts), default=0) * _MAX_UTF8 <= limit:
        return
    for text in texts:
        check_text(field, text, limit)


def check_node(node: base_pb2.Node, limits: FieldLimits) -> None:
    """Refuse a node with a field over its bound: the named fields first (the message names
    the one), then the whole node (extensions, client features, addresses, parameters)."""
    check_text("node.id", node.id, limits.node_id)
    check_text("node.cluster", node.cluster, limits.node_cluster)
    locality = node.locality
    for part in ("region", "zone", "sub_zone"):
        check_text(f"node.locality.{part}", getattr(locality, part), limits.node_locality)
    check_text("node.user_agent_name", node.user_agent_name, limits.node_user_agent)
    check_text("node.user_agent_version", node.user_agent_version, limits.node_user_agent)
    metadata = node.metadata.ByteSize()
    if metadata > limits.node_metadata:
        raise refuse("node.metadata (serialised)", metadata, limits.node_metadata)
    size = node.ByteSize()
    if size > limits.node:
        raise refuse("node (serialised)", size, limits.node)


def bounded_text(text: str, limit: int) -> str:
    """`text` if it is at most `limit` UTF-8 bytes, else its head and how long it was, within
    `limit` bytes in all (never splitting a character)."""
    if _fits(text, limit):
        return text
    marker = f" ... [truncated: {utf8_size(text)} bytes]"
    room = max(limit - len(marker), 0)
    head = text[:room].encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
    return head + marker
