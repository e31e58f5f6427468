"""The ``reference`` policy: the issue's 50-line controller that trimtab has to beat.

    every 2 s: scrape each server's KV-cache use (vllm:kv_cache_usage_perc), its waiting
               requests (vllm:num_requests_waiting) and its KV capacity (cache_config_info)
    w = 100 x cap_norm x (1 - kv_use) / (1 + waiting)      # cap_norm: capacity / pool max
    Envoy: least_request on those weights

(issue 11's definition; before it, the bench's reference had no ``/ (1 + waiting)`` term.)
Envoy weights are integers, so the product is rounded and clamped to [1, 100]
(:func:`reference_weights`).

It runs as ``trimtab serve`` with ``weights.policy: reference``
(:mod:`weight_calculator.reference`, the formula with trimtab's staleness and fail-static
handling, no smoothing). Everything else, the scraper, the xDS server and the generated Envoy
cluster, is the same code as the ``trimtab`` policy, so a difference between the two is the
weight policy (and the LB algorithm, when trimtab's differs). ``tests/dev/test_bench.py`` checks
the equivalence against :func:`reference_weights` on a grid of inputs.
"""

from __future__ import annotations

from collections.abc import Mapping

INTERVAL_S = 2.0  # the scrape period of the definition, whatever --interval says
MAX_WEIGHT = 100  # trimtab's default weights.max_weight

WEIGHTS = "reference"  # trimtab's weights.policy for it
LB_POLICY = "least_request"


def reference_weights(kv_usage: Mapping[str, float], capacity: Mapping[str, float],
                      waiting: Mapping[str, float] | None = None,
                      max_weight: int = MAX_WEIGHT) -> dict[str, int]:
    """``100 x cap_norm x (1 - kv_usage) / (1 + waiting)`` per endpoint, as Envoy weights."""
    top = max(capacity.values())
    waiting = waiting or {}
    return {address: max(1, min(max_weight, round(
                max_weight * (1.0 - kv) * capacity[address] / top
                / (1.0 + waiting.get(address, 0.0)))))
            for address, kv in kv_usage.items()}
