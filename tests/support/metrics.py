"""Metrics as a scrape sees them: read through the registry's public API, never a metric
object's internals (a series that is not exported reads as 0)."""

from __future__ import annotations

from prometheus_client import REGISTRY


def sample_value(name: str, **labels: str) -> float:
    """The value of the sample ``name{labels}`` (all its labels, exactly), or 0.0 if absent."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value
