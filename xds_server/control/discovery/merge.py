"""Pools whose endpoints come from Kubernetes EndpointSlices.

Each watcher hands over the latest endpoint set (level-based); the pool's endpoints in the
effective config are replaced by it and the controller re-applies the config, so everything
downstream (telemetry, weights, EDS) sees ordinary endpoints. Ready endpoints are HEALTHY;
terminating-but-serving ones are drained (DRAINING); not-serving ones are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from xds_server.config.pools import EndpointConfig, PoolConfig
from xds_server.config.schema import Config
from xds_server.control.discovery.kubernetes import (
    EndpointSet,
    EndpointSliceWatcher,
    make_api_client,
    watch_endpoint_slices,
)
from xds_server.envoy.clusters import DRAINING

log = logging.getLogger("trimtab.discovery")


def effective_config(base: Config, discovered: dict[str, EndpointSet]) -> Config:
    """`base` with every discovering pool's endpoints replaced by what was discovered."""
    pools = []
    for pool in base.pools:
        found = discovered.get(pool.name)
        if pool.discovery is None or found is None:
            pools.append(pool)
            continue
        endpoints = [EndpointConfig(address=ep.address, drain=ep.health == DRAINING)
                     for ep in found if ep.health is not None]
        pools.append(pool.model_copy(update={"endpoints": endpoints}))
    return base.model_copy(update={"pools": pools})


class Discovery:
    def __init__(self, on_change: Callable[[Config], None]) -> None:
        self.on_change = on_change
        self.discovered: dict[str, EndpointSet] = {}
        self.watchers: list[EndpointSliceWatcher] = []
        self.base: Config | None = None

    def start(self, base: Config) -> None:
        self.base = base
        for pool in base.pools:
            if pool.discovery is not None:
                self.watchers.append(self._watch(pool))

    def _watch(self, pool: PoolConfig) -> EndpointSliceWatcher:
        assert pool.discovery is not None
        k8s = pool.discovery.kubernetes
        client = make_api_client(host=k8s.api_server) if k8s.api_server else None
        watcher = watch_endpoint_slices(k8s.namespace, k8s.service, k8s.port_name,
                                        api_client=client,
                                        on_change=lambda found: self._update(pool.name, found))
        watcher.start()
        log.info("pool %s: watching EndpointSlices of %s/%s", pool.name, k8s.namespace,
                 k8s.service)
        return watcher

    def _update(self, pool: str, found: EndpointSet) -> None:
        self.discovered[pool] = found
        log.info("pool %s: %d endpoints discovered", pool, len(found))
        if self.base is not None:
            self.on_change(effective_config(self.base, self.discovered))

    def effective(self, base: Config) -> Config:
        return effective_config(base, self.discovered)

    async def close(self) -> None:
        for watcher in self.watchers:
            await watcher.aclose()
        self.watchers.clear()
