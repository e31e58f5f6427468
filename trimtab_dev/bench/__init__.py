"""`trimtab bench`: balancing policies compared through a real Envoy on the simulated fleet.

Modules: ``envoy_configs`` (the bootstraps and trimtab's config per policy), ``reference``
(the reference controller: capacity x (1 - KV use)), ``runner`` (processes, load, samplers),
``report`` (summaries, ratios, targets, seed spread, tables, JSON, PNG), ``cli``.
"""

from trimtab_dev.bench.envoy_configs import POLICIES

__all__ = ["POLICIES"]
