"""Rollouts whose canary shares a test sets by hand (no gates, no stepping), so the routes
they feed are reached the way the product reaches them: through ``Controller.reconcile``."""

from __future__ import annotations

from collections.abc import Mapping

from xds_server.config.schema import Config
from xds_server.control.rollouts.runner import Rollouts
from xds_server.control.slo import SloTracker


class PinnedRollouts(Rollouts):
    def __init__(self, config: Config, percent: Mapping[str, float] | None = None) -> None:
        super().__init__(config, state_file=None)
        self.pinned = dict(percent or {})

    def percents(self) -> dict[str, float]:
        return {pool: share for pool, share in self.pinned.items() if pool in self.pools}

    def tick(self, tracker: SloTracker, now: float) -> bool:
        return False
