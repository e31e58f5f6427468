"""Fault injection for tests: a controller that lets a test rewrite the resources it builds.

The product has no test hooks; tests build a :class:`HookedController` directly, and the
end-to-end harness runs ``trimtab serve`` with one through ``tests.support.launcher``.
"""

from __future__ import annotations

from collections.abc import Callable

from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf.message import Message

from xds_server.control.controller import Controller
from xds_server.xds import type_urls

Mutator = Callable[[dict[str, list[Message]]], None]


class HookedController(Controller):
    """A controller whose built resources pass through ``mutators`` before publishing."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.mutators: list[Mutator] = []
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def resources(self) -> dict[str, list[Message]]:
        messages = super().resources()
        for mutate in self.mutators:
            mutate(messages)
        return messages

    def _resource_inputs(self) -> tuple[object, ...]:
        return (*super()._resource_inputs(), *self.mutators)


def invalid_weight_mutator(pool: str) -> Mutator:
    """Give the pool's first endpoint load_balancing_weight 0, which Envoy NACKs."""

    def mutate(messages: dict[str, list[Message]]) -> None:
        for index, message in enumerate(messages[type_urls.ENDPOINT]):
            if isinstance(message, endpoint_pb2.ClusterLoadAssignment) and message.cluster_name == pool:
                broken = endpoint_pb2.ClusterLoadAssignment()
                broken.CopyFrom(message)
                broken.endpoints[0].lb_endpoints[0].load_balancing_weight.value = 0
                messages[type_urls.ENDPOINT][index] = broken

    return mutate
