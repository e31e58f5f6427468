"""KEDA External Scaler: lets KEDA scale model-server Deployments on trimtab's decisions.

Generated stubs (`externalscaler_pb2`, `externalscaler_pb2_grpc`) come from
``protos/externalscaler.proto`` via ``scripts/gen_protos.sh``; see ``protos/README.md``.
"""

from xds_server.keda.scaler import (
    POOL_METADATA_KEY,
    ExternalScalerServicer,
    InMemoryScaleSource,
    PoolScale,
    ScaleSource,
    metric_name,
    start_scaler_server,
)

__all__ = [
    "POOL_METADATA_KEY",
    "ExternalScalerServicer",
    "InMemoryScaleSource",
    "PoolScale",
    "ScaleSource",
    "metric_name",
    "start_scaler_server",
]
