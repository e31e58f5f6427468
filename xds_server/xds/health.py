"""gRPC health checking and server reflection for trimtab's gRPC servers.

Call `add_health_and_reflection` before ``server.start()``: gRPC documents handler
registration as a pre-start step (grpcio 1.85 happens to accept it later; do not rely on it).
It adds:

* ``grpc.health.v1.Health`` (grpcio-health-checking's asyncio servicer): the overall status
  ``""`` and every name in ``service_names`` start SERVING; flip them with
  `set_serving` (e.g. NOT_SERVING until the first snapshot, and on shutdown).
* ``grpc.reflection.v1alpha.ServerReflection`` (grpcio-reflection) listing ``service_names``,
  health and reflection itself. The xDS services are served with generic handlers, so their
  descriptors are not registered by any servicer; importing the ``*ds_pb2`` modules below puts
  them in the default descriptor pool, so ``grpcurl describe`` works on them too.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from envoy.service.cluster.v3 import cds_pb2  # noqa: F401 - registers the descriptor
from envoy.service.discovery.v3 import ads_pb2  # noqa: F401 - registers the descriptor
from envoy.service.endpoint.v3 import eds_pb2  # noqa: F401 - registers the descriptor
from envoy.service.listener.v3 import lds_pb2  # noqa: F401 - registers the descriptor
from envoy.service.route.v3 import rds_pb2  # noqa: F401 - registers the descriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# The services `xds_server.xds.server.XdsServicer` serves (checked by tests/xds/test_grpc_extras.py).
XDS_SERVICE_NAMES: tuple[str, ...] = (
    "envoy.service.discovery.v3.AggregatedDiscoveryService",
    "envoy.service.cluster.v3.ClusterDiscoveryService",
    "envoy.service.endpoint.v3.EndpointDiscoveryService",
    "envoy.service.listener.v3.ListenerDiscoveryService",
    "envoy.service.route.v3.RouteDiscoveryService",
)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(health.aio.HealthServicer):
    """The asyncio health servicer, created with some services already SERVING.

    The upstream ``set`` is a coroutine, so initial statuses cannot be set from sync setup
    code; seeding the status table here (before any watcher exists) is equivalent.
    """

    def __init__(self, serving: Iterable[str] = ()) -> None:
        super().__init__()
        for name in serving:
            self._server_status[name] = SERVING


def add_health_and_reflection(server: grpc.aio.Server,
                              service_names: list[str]) -> HealthServicer:
    """Add health checking and reflection for ``service_names`` to a not-yet-started server.

    Returns the health servicer; use `set_serving` (or its async ``set``) to change statuses
    and ``enter_graceful_shutdown()`` before stopping the server.
    """
    servicer = HealthServicer(["", *service_names])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = dict.fromkeys([*service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME])
    reflection.enable_server_reflection(list(names), server)
    return servicer


async def set_serving(servicer: HealthServicer, service_names: Iterable[str],
                      serving: bool) -> None:
    """Set each of ``service_names`` (``""`` is the whole server) SERVING or NOT_SERVING."""
    status = SERVING if serving else NOT_SERVING
    for name in service_names:
        await servicer.set(name, status)
