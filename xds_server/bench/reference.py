"""The ``reference`` policy: the issue's 50-line controller that trimtab has to beat.

    every 2 s: scrape each server's KV-cache use (vllm:kv_cache_usage_perc)
    weight = capacity x (1 - KV use)            # capacity: KV-cache tokens
    Envoy: least_request on those weights

Envoy weights are integers in [1, 128], so the product is scaled to the pool's largest
capacity and rounded, exactly as trimtab scales its own: ``clamp(round(100 x (1 - kv) x
capacity / max_capacity), 1, 100)`` (:func:`reference_weights`).

It runs as ``trimtab serve`` with a composite configuration that reduces to that formula
(:data:`COMPOSITE`): KV use is the only mixed signal, no EWMA, no deadband, and the DEGRADED
limits can never change a weight (``kv_degraded = 1``: ``1 - kv`` is already 0 there, so the
weight is 1 either way; the queue limit is out of reach). Everything else, the scraper, the
xDS server and the generated Envoy cluster, is the same code as the ``trimtab`` policy, so a
difference between the two is the weight policy alone. ``tests/test_bench.py`` checks the
equivalence against :func:`reference_weights` on a grid of inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

INTERVAL_S = 2.0  # the scrape period of the definition, whatever --interval says
MAX_WEIGHT = 100  # trimtab's default weights.max_weight

COMPOSITE: dict[str, Any] = {
    "memory_mix": 1.0, "queue_mix": 0.0, "latency_mix": 0.0,  # weight on KV use alone
    "ewma_alpha": 1.0, "deadband": 0.0,  # the new target is the weight, at once
    "kv_degraded": 1.0,  # DEGRADED only at kv = 1, where the formula gives 1 too
    "queue_cap": 1e12,  # the queue signal is not mixed; its DEGRADED limit is never reached
}


def reference_weights(kv_usage: Mapping[str, float], capacity: Mapping[str, float],
                      max_weight: int = MAX_WEIGHT) -> dict[str, int]:
    """``capacity x (1 - kv_usage)`` per endpoint, as integer Envoy weights."""
    top = max(capacity.values())
    return {address: max(1, min(max_weight,
                                round(max_weight * (1.0 - kv) * capacity[address] / top)))
            for address, kv in kv_usage.items()}
