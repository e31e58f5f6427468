"""`trimtab bench`: balancing policies compared through a real Envoy on the simulated fleet.

Modules: ``envoy_configs`` (the bootstraps and trimtab's config per policy), ``runner``
(processes, load, samplers), ``report`` (summaries, ratios, table, JSON, PNG), ``cli``.
"""

from .envoy_configs import POLICIES

__all__ = ["POLICIES"]
