"""The tick loop: telemetry -> weights -> resources -> snapshot -> cache.

One tick every `telemetry.interval_seconds`. Telemetry I/O happens here, never in a stream's
request loop. A snapshot is published only when its content changed, so an unchanged weight
pushes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from google.protobuf.message import Message

from weight_calculator.queueing import STANDBY
from weight_calculator.types import PoolWeights

from . import metrics, type_urls
from .adapters import screen_signals
from .auto_classes import AutoClass, capacities_of, derive_classes
from .autoscale import Autoscaler
from .cache import SnapshotCache
from .config import Config, EndpointConfig
from .resources import (
    DEGRADED,
    DRAINING,
    HEALTHY,
    EndpointSetting,
    build_cluster,
    build_clusters,
    build_load_assignment,
)
from .rollouts import Rollouts
from .routing import build_listener, build_route_config
from .service_history import ServiceHistory
from .slo import SloTracker, split_signals
from .snapshot import InconsistentSnapshotError, Snapshot, build_snapshot
from .sources import TelemetrySource, build_sources
from .telemetry import Scraper, ScrapeResult, TelemetryStore
from .weighing import LatencyWindow, cluster_weights

log = logging.getLogger("trimtab.controller")

Mutator = Callable[[dict[str, list[Message]]], None]


@dataclass
class TickStats:
    ticks: int = 0
    published: int = 0
    rejected: int = 0
    last_tick_at: float | None = None
    last_error: str | None = None
    stale: dict[str, bool] = field(default_factory=dict)  # "pool/address" -> stale
    problems: dict[str, tuple[str, ...]] = field(default_factory=dict)  # flagged endpoints


class Controller:
    def __init__(self, config: Config, cache: SnapshotCache, scraper: Scraper | None = None,
                 clock: Callable[[], float] = time.time, state_file: Path | None = None) -> None:
        self.cache = cache
        self.slo = SloTracker()
        self.rollouts = Rollouts(config, state_file)
        self.autoscaler = Autoscaler(config)
        self.clock = clock
        self.store = TelemetryStore()
        self.weights: dict[str, PoolWeights] = {}
        self.stats = TickStats()
        self.mutators: list[Mutator] = []  # test-only hooks (see admin's /v1/test routes)
        self.canary_percent: dict[str, float] = {}
        self.on_tick: list[Callable[[], None]] = []
        self._own_scraper = scraper is None
        self.scraper = scraper or self._new_scraper(config)
        self.latency = LatencyWindow(config.telemetry.latency_window_seconds)
        self.service = ServiceHistory()  # counter reads for the queueing policy
        self.sources: dict[str, TelemetrySource] = {}
        self.auto: dict[str, tuple[AutoClass, ...]] = {}  # long_context: auto, per pool
        self._auto_clusters: list[Message] = []
        self.apply_config(config)

    @staticmethod
    def _new_scraper(config: Config) -> Scraper:
        return Scraper(config.telemetry.scrape_timeout, config.telemetry.max_concurrency)

    def apply_config(self, config: Config) -> None:
        """Switch to a new (already validated) config; listener and routes are built here once."""
        self.config = config
        self.sources = build_sources(config, self.scraper, needs_slo(config))
        self._clusters = [c for pool in config.pools for c in build_clusters(pool)]
        self._listener = build_listener(config)
        self.auto = {name: c for name, c in self.auto.items()
                     if any(p.name == name and p.auto_classes for p in config.pools)}
        self._auto_clusters = self._build_auto_clusters()
        self._routes = build_route_config(config, self.canary_percent, self.auto)
        addresses = {ep.address for pool in config.pools for ep in pool.all_endpoints()}
        self.store.forget(addresses)
        self.slo.forget(addresses)
        self.latency.forget(addresses)
        self.service.forget(addresses)
        self.rollouts.apply_config(config)
        self.autoscaler.apply_config(config)
        names = {name for pool in config.pools for name, _, _ in pool.clusters()}
        self.weights = {k: v for k, v in self.weights.items() if k in names}

    def set_canary_percent(self, percent: Mapping[str, float]) -> None:
        """Route canary traffic shares (pool -> percent); rebuilds RDS only when it changed."""
        if dict(percent) != self.canary_percent:
            self.canary_percent = dict(percent)
            self._routes = build_route_config(self.config, self.canary_percent, self.auto)

    async def reload(self, config: Config) -> None:
        """Apply a new validated config and publish at once (telemetry settings included)."""
        old_sources = [s for k, s in self.sources.items() if k != "scrape"]
        if self._own_scraper:
            old, self.scraper = self.scraper, self._new_scraper(config)
            await old.close()
        for source in old_sources:
            await source.close()
        self.apply_config(config)
        self.ingest({})
        self.publish()

    async def collect(self) -> dict[str, ScrapeResult]:
        """Read every endpoint through its pool's source, the sources concurrently."""
        by_source: dict[str, dict[str, EndpointConfig]] = {}
        for pool in self.config.pools:
            group = by_source.setdefault(pool.source(self.config), {})
            group.update({ep.address: ep for ep in pool.all_endpoints()})
        answers = await asyncio.gather(*(self.sources[kind].collect(list(eps.values()), self.clock)
                                         for kind, eps in by_source.items()))
        return {address: result for answer in answers for address, result in answer.items()}

    async def tick(self) -> None:
        started = time.perf_counter()
        read_at = time.monotonic()  # convergence is measured from here to the ACK
        self.ingest(await self.collect())
        if self.rollouts.pools:
            self.rollouts.tick(self.slo, self.clock())
            self.set_canary_percent(self.rollouts.percents())
        self.autoscaler.tick(self.weights, self.slo, self.clock())
        self.publish(read_at)
        self.stats.ticks += 1
        self.stats.last_tick_at = self.clock()
        for hook in self.on_tick:
            hook()
        metrics.TICK_SECONDS.observe(time.perf_counter() - started)

    def ingest(self, results: dict[str, ScrapeResult]) -> None:
        """Record telemetry and recompute every pool's weights (pure function per pool)."""
        results = {address: self._record(address, r) for address, r in results.items()}
        now = self.clock()
        self.store.seen((ep.address for pool in self.config.pools
                         for ep in pool.all_endpoints()), now)
        weights = {}
        for pool in self.config.pools:
            for cluster, _, endpoints in pool.clusters():
                observations = self.store.observations(ep.address for ep in endpoints)
                weights[cluster] = cluster_weights(self.config, pool, endpoints, observations,
                                                   self.latency, now, self.weights.get(cluster),
                                                   self.service)
                self._note_pool(cluster, weights[cluster], results)
        self.weights = weights
        self._update_auto_classes()

    def _update_auto_classes(self) -> None:
        """Derive each ``long_context: auto`` pool's classes from the KV capacities known now;
        rebuild the derived clusters and the routes only when they changed."""
        auto: dict[str, tuple[AutoClass, ...]] = {}
        for pool in self.config.pools:
            if not pool.auto_classes:
                continue
            addresses = [ep.address for ep in pool.endpoints]
            read = {a: (o.sample.signals.get("kv_capacity_tokens") if o.sample else None)
                    for a, o in self.store.observations(addresses).items()}
            configured = {ep.address: ep.capacity for ep in pool.endpoints}
            classes = derive_classes(pool.name, capacities_of(addresses, configured, read))
            if classes:
                auto[pool.name] = classes
        if auto != self.auto:
            log.info("automatic prompt-size classes: %s", {
                p: [(c.cluster, c.min_prompt_bytes, c.max_prompt_bytes, len(c.addresses))
                    for c in cs] for p, cs in auto.items()} or "none")
            self.auto = auto
            self._auto_clusters = self._build_auto_clusters()
            self._routes = build_route_config(self.config, self.canary_percent, self.auto)

    def _build_auto_clusters(self) -> list[Message]:
        return [build_cluster(self.config.pool(name), c.cluster)
                for name, classes in self.auto.items() for c in classes]

    def _auto_assignments(self, settings: Mapping[str, Mapping[str, EndpointSetting]]
                          ) -> list[Message]:
        """Each derived cluster holds its members with the pool's own weights and health."""
        out: list[Message] = []
        for name, classes in self.auto.items():
            pool = self.config.pool(name)
            by_address = {ep.address: ep for ep in pool.endpoints}
            for c in classes:
                members = [by_address[a] for a in c.addresses if a in by_address]
                out.append(build_load_assignment(c.cluster, members, settings.get(name, {})))
        return out

    def _record(self, address: str, result: ScrapeResult) -> ScrapeResult:
        """Store one read; a NaN/negative/out-of-range signal is moved to its problems."""
        if result.signals is not None:
            plain, slo = split_signals(result.signals)
            self.slo.record(address, result.collected_at, slo)
            clean, rejected = screen_signals(plain)
            self.latency.record(address, result.collected_at, clean)
            self.service.record(address, result.collected_at, clean)
            result = replace(result, signals=clean, problems=result.problems + rejected)
        self.store.record(address, result)
        return result

    def _note_pool(self, pool: str, weights: PoolWeights, results: dict[str, ScrapeResult]) -> None:
        stale_count = 0
        for address, ew in weights.endpoints.items():
            key = f"{pool}/{address}"
            if self.stats.stale.get(key, False) != ew.stale:
                error = results[address].error if address in results else None
                log.log(logging.WARNING if ew.stale else logging.INFO,
                        "endpoint %s telemetry %s%s", key, "stale" if ew.stale else "recovered",
                        f": {error}" if ew.stale and error else "")
            self.stats.stale[key] = ew.stale
            stale_count += ew.stale
            self._note_problems(key, ew.problems)
            metrics.ENDPOINT_WEIGHT.labels(pool=pool, endpoint=address).set(ew.weight)
            metrics.ENDPOINT_STALE.labels(pool=pool, endpoint=address).set(int(ew.stale))
            for signal, value in ew.signals.items():
                metrics.ENDPOINT_SIGNAL.labels(pool=pool, endpoint=address, signal=signal).set(value)
            read = results.get(address)
            if read is not None and (read.error or read.problems):
                metrics.SCRAPE_ERRORS.labels(pool=pool).inc()
        metrics.STALE_ENDPOINTS.labels(pool=pool).set(stale_count)
        metrics.POOL_FAIL_STATIC.labels(pool=pool).set(int(weights.fail_static))

    def _note_problems(self, key: str, problems: tuple[str, ...]) -> None:
        """Log an endpoint's rejected inputs once per change (and once when they clear)."""
        if self.stats.problems.get(key, ()) == problems:
            return
        if problems:
            log.warning("endpoint %s telemetry input problems: %s", key, "; ".join(problems))
            self.stats.problems[key] = problems
        else:
            log.info("endpoint %s telemetry input problems cleared", key)
            del self.stats.problems[key]

    def settings(self) -> dict[str, dict[str, EndpointSetting]]:
        """cluster -> address -> EDS setting."""
        return {cluster: {address: EndpointSetting(ew.weight, _eds_health(ew.health))
                          for address, ew in pw.endpoints.items()}
                for cluster, pw in self.weights.items()}

    def resources(self) -> dict[str, list[Message]]:
        settings = self.settings()
        messages: dict[str, list[Message]] = {
            type_urls.CLUSTER: [*self._clusters, *self._auto_clusters],
            type_urls.ENDPOINT: [*(build_load_assignment(name, endpoints, settings.get(name, {}))
                                   for pool in self.config.pools
                                   for name, _, endpoints in pool.clusters()),
                                 *self._auto_assignments(settings)],
            type_urls.LISTENER: [self._listener],
            type_urls.ROUTE: [self._routes],
        }
        for mutate in self.mutators:
            mutate(messages)
        return messages

    def publish(self, read_at: float | None = None) -> bool:
        """Build, check and publish a snapshot. An inconsistent one is refused (our fault):
        logged, counted, and the last good snapshot stays in place. ``read_at`` (monotonic)
        is when the telemetry behind it was read; it stamps the changed EDS resources for
        the convergence histogram."""
        try:
            snapshot = build_snapshot(self.resources())
        except InconsistentSnapshotError as exc:
            self.stats.rejected += 1
            self.stats.last_error = str(exc)
            metrics.SNAPSHOT_REJECTED.inc()
            log.error("refusing snapshot, keeping the last good one: %s", exc)
            return False
        previous = self.cache.snapshot
        if not self.cache.set_snapshot(snapshot, read_at):
            return False
        self.stats.published += 1
        metrics.SNAPSHOTS.inc()
        log.info("published snapshot %s (%s)", snapshot.version, _describe_change(previous, snapshot))
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Tick on a fixed schedule until `stop` is set. A failing tick is logged, not fatal."""
        interval = self.config.telemetry.interval_seconds
        deadline = time.monotonic()
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive any single tick
                log.exception("telemetry tick failed")
            deadline = max(deadline + interval, time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=deadline - time.monotonic())

    async def close(self) -> None:
        for kind, source in self.sources.items():
            if kind != "scrape" or self._own_scraper:
                await source.close()


def needs_slo(config: Config) -> bool:
    """Canary gates and the autoscaler read latency histograms; plain weighting does not."""
    return config.keda.address is not None or any(
        pool.versions is not None or pool.scaling is not None for pool in config.pools)


def _eds_health(health: str) -> str:
    """DEGRADED reaches EDS as DEGRADED, the queueing policy's STANDBY as DRAINING (no new
    requests); stale or invalid telemetry is expressed through weight."""
    if health == STANDBY:
        return DRAINING
    return DEGRADED if health == DEGRADED else HEALTHY


def _describe_change(previous: Snapshot | None, snapshot: Snapshot) -> str:
    if previous is None:
        return "first snapshot"
    parts = []
    for type_url, items in snapshot.resources.items():
        old = previous.of_type(type_url)
        names = sorted(n for n, r in items.items() if n not in old or old[n].version != r.version)
        gone = sorted(set(old) - set(items))
        if names or gone:
            parts.append(f"{type_urls.short_name(type_url)}: changed {names}"
                         + (f" removed {gone}" if gone else ""))
    return "; ".join(parts) or "no change"
