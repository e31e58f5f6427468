"""What sets the emulated Envoy's weights in the lab: nothing (Envoy's own least_request or
round robin), the issue's reference controller, Envoy's ORCA-fed CSWRR, or trimtab's own
weighing path fed the simulator's metrics pages through trimtab's parser.

Each controller has ``tick(now, servers)`` (every ``interval`` seconds; returns the weights
and EDS health to push, or None) and ``report(now, address, server)`` (each response's
headers; only CSWRR reads them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest

from trimtab_dev.bench.reference import reference_weights
from trimtab_dev.sim.engine import Engine
from trimtab_dev.sim.exposition import MetricsCollector, occupancy
from trimtab_dev.sim.server import ServerConfig
from weight_calculator.types import Observation, PoolWeights, Sample
from xds_server.config.schema import Config
from xds_server.control.weights import LatencyWindow, cluster_weights
from xds_server.envoy.build import eds_health, eds_priority
from xds_server.envoy.prompt_classes import (
    BYTES_PER_TOKEN,
    AutoClass,
    derive_classes,
    service_rates_of,
)
from xds_server.telemetry.counters import ServiceHistory
from xds_server.telemetry.reading import screen_signals
from xds_server.telemetry.sources import page_parser

EPOCH = 1.7e9  # virtual time 0 as unix seconds: trimtab's clock reads like a real one


@dataclass
class LabServer:
    """What the metrics page and the ORCA header of one simulated server are rendered from."""

    config: ServerConfig
    engine: Engine
    address: str
    uuid: str = ""
    completions: list[float] = field(default_factory=list)

    def page(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MetricsCollector(self))  # type: ignore[arg-type]
        return generate_latest(registry).decode()


@dataclass(frozen=True)
class Derived:
    """A derived prompt-size cluster (``long_context: auto``): requests of ``[min_tokens,
    max_tokens)`` prompt tokens go to ``addresses``."""

    cluster: str
    min_tokens: int
    max_tokens: int | None
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Push:
    """What one tick sends Envoy: host weights and EDS health, the localities (address ->
    locality) and their weights when there are some, and the derived clusters."""

    weights: Mapping[str, int]
    health: Mapping[str, str] = field(default_factory=dict)
    localities: Mapping[str, str] | None = None
    locality_weights: Mapping[str, float] | None = None
    derived: tuple[Derived, ...] = ()
    priorities: Mapping[str, int] = field(default_factory=dict)  # 1: standby


class Controller(Protocol):
    interval: float

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None: ...

    def report(self, now: float, server: LabServer) -> None: ...


class Static:
    """No controller: every weight 1 (Envoy's own policy alone)."""

    interval = math.inf

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None:
        return None

    def report(self, now: float, server: LabServer) -> None:
        return None


class Fixed:
    """Weights fixed per server-name prefix (``h100=100``); 0 puts a server on DRAINING: the
    ceiling of a static split, for comparison."""

    interval = 1e9

    def __init__(self, by_prefix: Mapping[str, float], localities: bool = False) -> None:
        self.by_prefix = dict(by_prefix)
        self.localities = localities

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None:
        weights: dict[str, int] = {}
        health: dict[str, str] = {}
        prio: dict[str, int] = {}
        loc: dict[str, str] = {}
        loc_w: dict[str, float] = {}
        for s in servers:
            k, w = next(((k, v) for k, v in self.by_prefix.items()
                         if s.config.name.startswith(k)), ("", 1.0))
            weights[s.address] = 1 if self.localities else max(1, int(w))
            health[s.address] = "HEALTHY"
            prio[s.address] = 1 if w <= 0 else 0  # 0: standby, as trimtab sends it
            loc[s.address], loc_w[k] = k, max(w, 1.0)
        if self.localities:
            return Push(weights, health, loc, loc_w, priorities=prio)
        return Push(weights, health, priorities=prio)

    def report(self, now: float, server: LabServer) -> None:
        return None


class Reference:
    """The issue's 50-line controller: ``100 cap_norm (1 - kv) / (1 + waiting)`` every 2 s."""

    interval = 2.0

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None:
        kv = {s.address: s.engine.kv_usage for s in servers}
        cap = {s.address: float(s.engine.kv_capacity_tokens) for s in servers}
        waiting = {s.address: float(s.engine.num_waiting) for s in servers}
        return Push(reference_weights(kv, cap, waiting))

    def report(self, now: float, server: LabServer) -> None:
        return None


@dataclass
class _Orca:
    weight: int | None = None
    non_empty_since: float | None = None
    last_update: float = -math.inf


class Cswrr:
    """Envoy's client_side_weighted_round_robin on the simulator's ORCA reports: each response
    carries ``rps_fractional`` (completions/s over 10 s) and ``application_utilization``
    (occupancy); weight ``int(qps / utilization)`` (at least 1), valid after ``blackout`` s of
    reports and until ``expiration`` s without one; hosts without a valid weight get the
    median of the valid ones. Recomputed every ``interval`` (1 s), as the bench configures it."""

    def __init__(self, blackout: float = 2.0, expiration: float = 180.0,
                 interval: float = 1.0) -> None:
        self.blackout, self.expiration, self.interval = blackout, expiration, interval
        self.hosts: dict[str, _Orca] = {}

    def report(self, now: float, server: LabServer) -> None:
        e = server.engine
        qps = e.completion_rate(now)
        util = occupancy(e)
        h = self.hosts.setdefault(server.address, _Orca())
        if qps <= 0 or util <= 0:
            return
        h.weight = max(1, int(qps / util))
        h.last_update = now
        if h.non_empty_since is None:
            h.non_empty_since = now

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None:
        valid: dict[str, int] = {}
        for s in servers:
            h = self.hosts.setdefault(s.address, _Orca())
            if now - h.last_update >= self.expiration:
                h.non_empty_since = None
            if (h.weight is not None and h.non_empty_since is not None
                    and now - h.non_empty_since >= self.blackout):
                valid[s.address] = h.weight
        ordered = sorted(valid.values())
        default = 1
        if ordered:
            mid = len(ordered) // 2
            default = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) // 2
        return Push({s.address: valid.get(s.address, default) for s in servers})


class Trimtab:
    """trimtab's weighing as ``trimtab serve`` runs it: each server's metrics page parsed by
    trimtab's parser, the counters into the service history, the pool weighed by
    :func:`cluster_weights` under ``config`` (one pool whose endpoints are the servers)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = config.pools[0]
        self.interval = config.telemetry.interval_seconds
        self.service = ServiceHistory()
        self.latency = LatencyWindow(config.telemetry.latency_window_seconds)
        self.samples: dict[str, Sample] = {}
        self.previous: PoolWeights | None = None
        self.classes: tuple[AutoClass, ...] = ()
        self.history: list[tuple[float, PoolWeights]] = []
        self._parse = page_parser(None, None, False)

    def report(self, now: float, server: LabServer) -> None:
        return None

    def tick(self, now: float, servers: Sequence[LabServer]) -> Push | None:
        at = EPOCH + now
        for s in servers:
            parsed = self._parse(s.page())
            clean, _ = screen_signals(parsed.signals)
            self.latency.record(s.address, at, parsed.itl)
            self.service.record(s.address, at, clean)
            self.samples[s.address] = Sample(at, clean)
        observations = {ep.address: Observation(self.samples.get(ep.address), None, EPOCH)
                        for ep in self.pool.endpoints}
        weights = cluster_weights(self.config, self.pool, self.pool.endpoints, observations,
                                  self.latency, at, self.previous, self.service)
        self.previous = weights
        self.history.append((now, weights))
        health = {a: eds_health(ew.health) for a, ew in weights.endpoints.items()}
        prio = {a: eds_priority(ew.health) for a, ew in weights.endpoints.items()}
        host = {a: ew.weight for a, ew in weights.endpoints.items()}
        derived = self._derived(weights) if self.pool.auto_classes else ()
        if weights.localities:
            loc = {a: ew.locality or "" for a, ew in weights.endpoints.items()}
            return Push(host, health, loc, dict(weights.localities), derived, prio)
        if derived:  # as envoy.build does: share weights (no divisor) in derived clusters
            host = {a: int(ew.breakdown.get("share_weight", ew.weight))
                    for a, ew in weights.endpoints.items()}
        return Push(host, health, derived=derived, priorities=prio)

    def _derived(self, weights: PoolWeights) -> tuple[Derived, ...]:
        """The pool's automatic prompt-size classes, derived as the controller does."""
        capacities = {a: s.signals.get("kv_capacity_tokens") for a, s in self.samples.items()}
        self.classes = derive_classes(self.pool.name, capacities, service_rates_of(weights),
                                      self.interval, self.classes)
        return tuple(Derived(c.cluster, c.min_prompt_bytes // BYTES_PER_TOKEN,
                             None if c.max_prompt_bytes is None
                             else c.max_prompt_bytes // BYTES_PER_TOKEN, c.addresses)
                     for c in self.classes)


def trimtab_config(addresses: Sequence[str], lb_policy: str = "least_request",
                   queueing: Mapping[str, Any] | None = None, weights: str = "queueing",
                   bias: float | None = None, auto_classes: bool = False) -> Config:
    pool: dict[str, Any] = {"name": "fleet", "model": "m", "lb_policy": lb_policy,
                            "endpoints": [{"address": a} for a in addresses]}
    if auto_classes:
        pool["long_context"] = "auto"
    if bias is not None:
        pool["active_request_bias"] = bias
    return Config.model_validate({
        "pools": [pool],
        "weights": {"policy": weights, "queueing": dict(queueing or {})},
    })
