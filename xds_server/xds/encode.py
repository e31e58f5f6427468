"""Hand-assembled protobuf wire encoding for xDS responses.

A response is a concatenation of fields, so the expensive part (each resource, already wrapped
as a ``resources`` field) is encoded once per resource version and shared by every stream; only
the small per-stream fields (version, nonce) are encoded per response. Protobuf parsers accept
fields in any order, so the result parses exactly like a message built field by field.
"""

from __future__ import annotations

from collections.abc import Iterable

_LEN = 2  # wire type for length-delimited fields


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    """Encode a length-delimited field (bytes, string or sub-message)."""
    return varint((number << 3) | _LEN) + varint(len(payload)) + payload


def str_field(number: int, text: str) -> bytes:
    """Encode a string field; empty strings are omitted as proto3 does."""
    return len_field(number, text.encode("utf-8")) if text else b""


def any_message(type_url: str, payload: bytes) -> bytes:
    """google.protobuf.Any{type_url=1, value=2}."""
    return str_field(1, type_url) + len_field(2, payload)


# DiscoveryResponse: version_info=1, resources=2, type_url=4, nonce=5
def sotw_resource_field(type_url: str, payload: bytes) -> bytes:
    return len_field(2, any_message(type_url, payload))


def sotw_response(version: str, resource_fields: Iterable[bytes], type_url: str,
                  nonce: str) -> bytes:
    return b"".join((str_field(1, version), *resource_fields, str_field(4, type_url),
                     str_field(5, nonce)))


# DeltaDiscoveryResponse: system_version_info=1, resources=2, type_url=4, nonce=5,
# removed_resources=6.  Resource: version=1, resource=2, name=3.
def delta_resource_field(type_url: str, name: str, version: str, payload: bytes) -> bytes:
    resource = str_field(1, version) + len_field(2, any_message(type_url, payload)) + str_field(3, name)
    return len_field(2, resource)


def delta_removed_field(name: str) -> bytes:
    return str_field(6, name)


def delta_response(system_version: str, resource_fields: Iterable[bytes], type_url: str,
                   nonce: str, removed: Iterable[str]) -> bytes:
    removed_fields = (delta_removed_field(name) for name in removed)
    return b"".join((str_field(1, system_version), *resource_fields, str_field(4, type_url),
                     str_field(5, nonce), *removed_fields))
