"""Pure weight functions: (samples, policy, now) -> weights. No clocks, no I/O."""

from weight_calculator.gpu_memory import compute_pool_weights, gpu_memory_weight
from weight_calculator.types import (
    EndpointWeight,
    GpuMemoryPolicy,
    Observation,
    PoolWeights,
    Sample,
)

__all__ = [
    "EndpointWeight",
    "GpuMemoryPolicy",
    "Observation",
    "PoolWeights",
    "Sample",
    "compute_pool_weights",
    "gpu_memory_weight",
]
