"""Test-only fault injection, enabled by TRIMTAB_TEST_HOOKS=1 (never in production)."""

from __future__ import annotations

from collections.abc import Callable

from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message

from xds_server.xds import type_urls


def invalid_weight_mutator(pool: str) -> Callable[[dict[str, list[Message]]], None]:
    """Give the pool's first endpoint load_balancing_weight 0, which Envoy NACKs."""

    def mutate(messages: dict[str, list[Message]]) -> None:
        for index, message in enumerate(messages[type_urls.ENDPOINT]):
            if isinstance(message, endpoint_pb2.ClusterLoadAssignment) and message.cluster_name == pool:
                broken = endpoint_pb2.ClusterLoadAssignment()
                broken.CopyFrom(message)
                broken.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0
                messages[type_urls.ENDPOINT][index] = broken

    return mutate
