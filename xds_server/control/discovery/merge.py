"""Discovered endpoints merged into the config: Kubernetes EndpointSlices or InferencePools,
and DNS names.

Each Kubernetes watcher (a Service's EndpointSlices, or an InferencePool's selected pods, whose
model names are the pool's config's) hands over the latest endpoint set (level-based); the
pool's endpoints in the effective config are replaced by it. Ready endpoints are HEALTHY;
terminating-but-serving ones are drained (DRAINING); not-serving ones are left out.

Endpoints addressed by DNS name become one endpoint per address the name resolves to now
(:mod:`.dns`; none while it has none). Either kind of change hands the effective config to
``on_change`` (``controller.reconcile`` in ``trimtab serve``), so everything downstream
(telemetry, weights, EDS) sees ordinary ``IP:port`` endpoints, through one reconcile path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from xds_server.config.addresses import is_ip
from xds_server.config.pools import EndpointConfig, PoolConfig
from xds_server.config.schema import Config
from xds_server.control.discovery.dns import (
    DnsResolver,
    Resolved,
    config_names,
    resolved_endpoints,
)
from xds_server.control.discovery.inference_pool import watch_inference_pool
from xds_server.control.discovery.kubernetes import (
    EndpointSet,
    make_api_client,
    watch_endpoint_slices,
)
from xds_server.envoy.clusters import DRAINING

log = logging.getLogger("trimtab.discovery")


class Watcher(Protocol):
    """What Discovery needs of a Kubernetes watcher: an EndpointSliceWatcher (a Service's
    slices) or an InferencePoolWatcher (an InferencePool's selected pods; the pool's model
    names are its config's, an InferencePool carries none)."""

    def start(self) -> None: ...

    async def aclose(self) -> None: ...


def _expanded(endpoints: list[EndpointConfig], resolved: Resolved) -> list[EndpointConfig]:
    """Each named endpoint as its addresses; an address met twice in one cluster (a name
    resolving to an IP also listed) appears once, as first met."""
    out: list[EndpointConfig] = []
    seen: set[str] = set()
    for endpoint in endpoints:
        for each in resolved_endpoints(endpoint, resolved):
            if each.address not in seen:
                seen.add(each.address)
                out.append(each)
    return out


def _resolved_pool(pool: PoolConfig, resolved: Resolved) -> PoolConfig:
    if all(is_ip(ep.host_port.host) for ep in pool.all_endpoints()):
        return pool  # the same object: nothing to resolve
    if pool.versions is None:
        return pool.model_copy(update={"endpoints": _expanded(pool.endpoints, resolved)})
    versions = {name: version.model_copy(update={"endpoints": _expanded(version.endpoints,
                                                                          resolved)})
                for name, version in pool.versions.items()}
    return pool.model_copy(update={"versions": versions})


def effective_config(base: Config, discovered: dict[str, EndpointSet],
                     resolved: Resolved | None = None) -> Config:
    """`base` with every discovering pool's endpoints replaced by what was discovered, and
    every endpoint addressed by DNS name replaced by one endpoint per address in `resolved`
    (name -> IPs; a name missing there has no endpoint)."""
    pools = []
    for pool in base.pools:
        found = discovered.get(pool.name)
        if pool.discovery is None or found is None:
            pools.append(_resolved_pool(pool, resolved or {}))
            continue
        endpoints = [EndpointConfig(address=ep.address, drain=ep.health == DRAINING)
                     for ep in found if ep.health is not None]
        pools.append(pool.model_copy(update={"endpoints": endpoints}))
    return base.model_copy(update={"pools": pools})


class Discovery:
    """The discovery sources of one config: a Kubernetes watcher per discovering pool (a
    Service's EndpointSlices or an InferencePool's pods) and the DNS resolver of its endpoint
    host names. Every change calls ``on_change`` with the
    effective config. The DNS cache outlives :meth:`close` (a reload keeps it)."""

    def __init__(self, on_change: Callable[[Config], None],
                 dns: DnsResolver | None = None) -> None:
        self.on_change = on_change
        self.discovered: dict[str, EndpointSet] = {}
        self.watchers: list[Watcher] = []
        self.base: Config | None = None
        self.dns = dns or DnsResolver()
        self._dns_task: asyncio.Task[None] | None = None
        self._dns_first_pass = asyncio.Event()

    def start(self, base: Config) -> None:
        """Start watching (from the running loop). With DNS names, their resolution starts
        at once; :meth:`dns_settled` waits for its first round."""
        self.base = base
        for pool in base.pools:
            if pool.discovery is not None:
                self.watchers.append(self._watch(pool))
        names = config_names(base)
        self.dns.configure(base.discovery.dns)
        self._dns_first_pass = asyncio.Event()
        if names:
            log.info("resolving %d endpoint host names every %gs", len(names),
                     base.discovery.dns.refresh_seconds)
            self._dns_task = asyncio.get_running_loop().create_task(
                self.dns.run(names, self._dns_changed, self._dns_first_pass),
                name="trimtab-dns")
        else:
            self._dns_first_pass.set()

    async def dns_settled(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) for the first round of DNS lookups; True when
        it is done (or there are no names)."""
        try:
            async with asyncio.timeout(timeout):
                await self._dns_first_pass.wait()
        except TimeoutError:
            return False
        return True

    def _dns_changed(self) -> None:
        if self.base is not None:
            self.on_change(self.effective(self.base))

    def _watch(self, pool: PoolConfig) -> Watcher:
        assert pool.discovery is not None
        k8s = pool.discovery.kubernetes
        client = make_api_client(host=k8s.api_server) if k8s.api_server else None

        def update(found: EndpointSet) -> None:
            self._update(pool.name, found)

        watcher: Watcher
        if k8s.inference_pool is not None:
            watcher = watch_inference_pool(k8s.namespace, k8s.inference_pool,
                                           api_client=client, on_change=update)
            what = f"InferencePool {k8s.namespace}/{k8s.inference_pool} and its pods"
        else:
            assert k8s.service is not None  # the config requires one of the two
            watcher = watch_endpoint_slices(k8s.namespace, k8s.service, k8s.port_name,
                                            api_client=client, on_change=update)
            what = f"EndpointSlices of {k8s.namespace}/{k8s.service}"
        watcher.start()
        log.info("pool %s: watching %s", pool.name, what)
        return watcher

    def _update(self, pool: str, found: EndpointSet) -> None:
        self.discovered[pool] = found
        log.info("pool %s: %d endpoints discovered", pool, len(found))
        if self.base is not None:
            self.on_change(self.effective(self.base))

    def effective(self, base: Config) -> Config:
        return effective_config(base, self.discovered, self.dns.resolved())

    async def close(self) -> None:
        if self._dns_task is not None:
            task, self._dns_task = self._dns_task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for watcher in self.watchers:
            await watcher.aclose()
        self.watchers.clear()
