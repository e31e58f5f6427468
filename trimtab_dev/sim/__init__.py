"""Simulated LLM model servers (vLLM-compatible HTTP, metrics and ORCA) for benchmarks.

See docs/simulator.md for the model, its parameters and their sources.
"""

from trimtab_dev.sim.engine import Engine, ManualClock, SimRequest, estimate_capacity, run_virtual
from trimtab_dev.sim.fleet import FleetError, FleetSpec, SimFleet, load_fleet, parse_fleet
from trimtab_dev.sim.profiles import (
    GPUS,
    MODELS,
    Efficiency,
    GpuProfile,
    ModelProfile,
    kv_capacity_tokens,
)

__all__ = [
    "GPUS", "MODELS", "Efficiency", "Engine", "FleetError", "FleetSpec", "GpuProfile",
    "ManualClock", "ModelProfile", "SimFleet", "SimRequest", "estimate_capacity",
    "kv_capacity_tokens", "load_fleet", "parse_fleet", "run_virtual",
]
