"""KEDA External Scaler (gRPC) backed by trimtab's autoscaler decisions.

A KEDA ``ScaledObject`` with an ``external`` trigger whose metadata has ``pool: <name>`` asks
this server about that pool. Metric semantics (chosen so KEDA's HPA lands exactly on
trimtab's own decision):

* ``GetMetricSpec`` -> one metric ``trimtab-<pool>-desired-replicas`` with target 1
  (``targetSize = 1``, ``targetSizeFloat = 1.0``).
* ``GetMetrics``    -> ``metricValue = metricValueFloat = desired_replicas(pool)``.

KEDA's default ``metricType`` is ``AverageValue``, for which the HPA computes
``ceil(metricValue / target) = desired_replicas``. The HPA still applies its own 10 %
tolerance and stabilisation windows on top of trimtab's cooldowns; set
``advanced.horizontalPodAutoscalerConfig.behavior`` in the ScaledObject to zero windows
(deploy/ does) so trimtab's cooldowns are the only ones. ``IsActive``/``StreamIsActive``
report ``is_active(pool)``, which KEDA uses for scaling to and from zero.

Errors: missing or malformed ``scalerMetadata.pool`` (or a missing ``scaledObjectRef``, or a
``metricName`` that is not ours, or anything over a bound of `xds_server.keda.bounds`: the
ScaledObject's name and namespace, the metadata's entries, keys and values, the message) ->
``INVALID_ARGUMENT`` naming the field and the limit; a pool the source does not know ->
``NOT_FOUND`` naming it and how many pools there are (not which). Other metadata keys (KEDA
also passes ``scalerAddress``) are ignored. An error quotes a client's string bounded and
escaped (`bounds.shown`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

import grpc

from xds_server.keda import externalscaler_pb2 as pb2
from xds_server.keda import externalscaler_pb2_grpc as pb2_grpc
from xds_server.keda.bounds import (
    MAX_MESSAGE_BYTES,
    MAX_METRIC_NAME_CHARS,
    MAX_POOL_CHARS,
    ref_problem,
    shown,
)

log = logging.getLogger("trimtab.keda")

POOL_METADATA_KEY = "pool"


def metric_name(pool: str) -> str:
    """The external metric trimtab reports for ``pool``."""
    return f"trimtab-{pool}-desired-replicas"


class ScaleSource(Protocol):
    """What the scaler serves. Methods are called on the event loop and must not block.

    ``wait_for_change`` returns after any change to any pool. It must register its waiter
    before its first suspension (as an ``asyncio.Event`` does), so a change made between a
    read and the wait is never lost; changes must be made on the event loop's thread.
    """

    def pool_names(self) -> Collection[str]: ...

    def score(self, pool: str) -> float | None: ...

    def desired_replicas(self, pool: str) -> int: ...

    def is_active(self, pool: str) -> bool: ...

    async def wait_for_change(self) -> None: ...


@dataclass(frozen=True)
class PoolScale:
    """One pool's current scaling answer."""

    desired_replicas: int
    score: float | None = None
    active: bool | None = None  # None: active while desired_replicas > 0

    @property
    def is_active(self) -> bool:
        return self.desired_replicas > 0 if self.active is None else self.active


class InMemoryScaleSource:
    """A `ScaleSource` the control loop updates every tick (call from the event loop)."""

    def __init__(self, pools: dict[str, PoolScale] | None = None) -> None:
        self._pools: dict[str, PoolScale] = dict(pools or {})
        self._changed = asyncio.Event()

    def update(self, pool: str, scale: PoolScale) -> None:
        """Set ``pool``'s answer; wakes waiters only if it differs from the current one."""
        if self._pools.get(pool) != scale:
            self._pools[pool] = scale
            self._notify()

    def remove(self, pool: str) -> None:
        if self._pools.pop(pool, None) is not None:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def pool_names(self) -> Collection[str]:
        return tuple(self._pools)

    def score(self, pool: str) -> float | None:
        return self._pools[pool].score

    def desired_replicas(self, pool: str) -> int:
        return self._pools[pool].desired_replicas

    def is_active(self, pool: str) -> bool:
        return self._pools[pool].is_active

    async def wait_for_change(self) -> None:
        await self._changed.wait()


def _malformed(value: str) -> bool:
    return not value or any(ch.isspace() or not ch.isprintable() for ch in value)


class ExternalScalerServicer(pb2_grpc.ExternalScalerServicer):
    """KEDA's ``externalscaler.ExternalScaler`` service over a `ScaleSource`."""

    def __init__(self, source: ScaleSource) -> None:
        self.source = source

    async def _pool_of(self, ref: pb2.ScaledObjectRef, context: grpc.aio.ServicerContext) -> str:
        problem = ref_problem(ref)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if POOL_METADATA_KEY not in ref.scalerMetadata:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"scalerMetadata.{POOL_METADATA_KEY} is required (the trimtab "
                                f"pool to scale); ScaledObject "
                                f"{shown(ref.namespace)}/{shown(ref.name)}")
        pool = ref.scalerMetadata[POOL_METADATA_KEY]
        if _malformed(pool) or len(pool) > MAX_POOL_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"scalerMetadata.{POOL_METADATA_KEY}: expected a pool name "
                                f"without whitespace, at most {MAX_POOL_CHARS} chars, got "
                                f"{shown(pool)}")
        await self._check_known(pool, context)
        return pool

    async def _check_known(self, pool: str, context: grpc.aio.ServicerContext) -> None:
        known = self.source.pool_names()
        if pool not in known:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"unknown pool {shown(pool)}: trimtab has {len(known)} pools "
                                f"and none by that name (see its /v1/weights)")

    async def IsActive(self, request: pb2.ScaledObjectRef,
                       context: grpc.aio.ServicerContext) -> pb2.IsActiveResponse:
        pool = await self._pool_of(request, context)
        return pb2.IsActiveResponse(result=self.source.is_active(pool))

    async def StreamIsActive(self, request: pb2.ScaledObjectRef,
                             context: grpc.aio.ServicerContext) -> None:
        """Send the current state at once, then every time it flips, until cancelled."""
        pool = await self._pool_of(request, context)
        sent: bool | None = None
        while True:
            await self._check_known(pool, context)
            active = self.source.is_active(pool)
            if active != sent:
                await context.write(pb2.IsActiveResponse(result=active))
                sent = active
                continue  # re-read: it may have changed while we were writing
            await self.source.wait_for_change()

    async def GetMetricSpec(self, request: pb2.ScaledObjectRef,
                            context: grpc.aio.ServicerContext) -> pb2.GetMetricSpecResponse:
        pool = await self._pool_of(request, context)
        spec = pb2.MetricSpec(metricName=metric_name(pool), targetSize=1, targetSizeFloat=1.0)
        return pb2.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(self, request: pb2.GetMetricsRequest,
                         context: grpc.aio.ServicerContext) -> pb2.GetMetricsResponse:
        if not request.HasField("scaledObjectRef"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "scaledObjectRef is required")
        if len(request.metricName) > MAX_METRIC_NAME_CHARS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"metricName: {len(request.metricName)} chars, over the limit "
                                f"of {MAX_METRIC_NAME_CHARS}")
        pool = await self._pool_of(request.scaledObjectRef, context)
        name = metric_name(pool)
        if request.metricName not in ("", name):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown metricName {shown(request.metricName)} for pool "
                                f"{shown(pool)}; expected {shown(name)}")
        desired = max(0, int(self.source.desired_replicas(pool)))
        score = self.source.score(pool)
        log.debug("KEDA GetMetrics %s: desired %d, score %s", pool, desired,
                  "n/a" if score is None or math.isnan(score) else f"{score:.3f}")
        value = pb2.MetricValue(metricName=name, metricValue=desired,
                                metricValueFloat=float(desired))
        return pb2.GetMetricsResponse(metricValues=[value])


async def start_scaler_server(
    servicer: ExternalScalerServicer, address: str,
    configure: Callable[[grpc.aio.Server], object] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve ``servicer`` on ``address`` (port 0 picks a free port); returns (server, port).

    ``configure`` runs before the server starts, e.g. to add health and reflection with
    `xds_server.xds.health.add_health_and_reflection`. SO_REUSEPORT is off, so a port
    already in use raises OSError instead of silently sharing it with another process; a
    message over `MAX_MESSAGE_BYTES` is refused by gRPC (RESOURCE_EXHAUSTED).
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    pb2_grpc.add_ExternalScalerServicer_to_server(servicer, server)
    if configure is not None:
        configure(server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises instead of returning 0 on a bind error
        raise OSError(f"cannot bind the KEDA external scaler to {address}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind the KEDA external scaler to {address}")
    await server.start()
    return server, port
