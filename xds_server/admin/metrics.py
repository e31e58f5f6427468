"""Prometheus metrics (prometheus-client). Every name is documented in docs/metrics.md.

Events (pushes, NACKs, ticks, errors) are counters and histograms on the global registry,
updated where they happen. What describes the fleet now (each endpoint's weight, staleness
and inputs; each pool's stale count and fail-static state) is not stored in gauges at all:
:class:`FleetCollector` renders it from the weights in force when Prometheus scrapes, so an
endpoint or pool that is gone has no series and no code has to remove any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from weight_calculator.types import PoolWeights

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)

ADMISSION_LIMIT = Gauge("trimtab_admission_limit",
                        "Requests one Envoy may hold in flight to a cluster (its circuit-breaker "
                        "limit over RTDS), by priority; absent: no budget, everything admitted",
                        ["cluster", "priority"])
ADMISSION_BUDGET = Gauge("trimtab_admission_budget",
                         "A cluster's admission budget: requests in flight across every Envoy",
                         ["cluster"])
ADMISSION_SPILL = Gauge("trimtab_admission_spill",
                        "Share of a pool's new requests sent to its fallback while it is over "
                        "its admission budget (0..1)", ["pool"])
ADMISSION_ENVOYS = Gauge("trimtab_admission_envoys",
                         "Envoys sharing a cluster's admission budget", ["cluster"])
ADMISSION_TENANT_RATE = Gauge("trimtab_admission_tenant_rate",
                              "A pool's tenant cap: requests a second each tenant may send "
                              "through one Envoy while it is enforced", ["cluster"])
ADMISSION_TENANT_ENFORCED = Gauge("trimtab_admission_tenant_enforced",
                                  "1 while a pool's tenant cap refuses (the pool is pressed), "
                                  "else 0", ["cluster"])
STREAMS = Gauge("trimtab_xds_streams", "Open xDS streams", ["api"])
SUBSCRIPTIONS = Gauge("trimtab_xds_subscriptions",
                      "Resource types requested on open xDS streams (streams by type)",
                      ["type", "api"])
PUSHES = Counter("trimtab_xds_pushes_total", "xDS responses sent", ["type", "api"])
PUSH_RESOURCES = Counter("trimtab_xds_pushed_resources_total",
                         "Resources carried by xDS responses", ["type"])
PUSH_BYTES = Counter("trimtab_xds_pushed_bytes_total", "Bytes of xDS responses sent", ["type"])
PUSH_SECONDS = Histogram("trimtab_xds_push_duration_seconds",
                         "Time to encode and hand one xDS response to gRPC", ["type"],
                         buckets=_LATENCY_BUCKETS)
ACKS = Counter("trimtab_xds_acks_total", "ACKs received", ["type"])
NACKS = Counter("trimtab_xds_nacks_total", "NACKs received (the client rejected a version)",
                ["type"])
STALE_NONCES = Counter("trimtab_xds_stale_nonces_total",
                       "Requests ignored because their nonce was stale", ["type"])
PROTOCOL_ERRORS = Counter("trimtab_xds_protocol_errors_total",
                          "Streams closed for breaking the xDS protocol", ["api"])
OBSERVER_FAILURES = Counter("trimtab_xds_observer_failures_total",
                            "Stream observer calls that raised (ours: logged, the stream goes on)",
                            ["observer"])
SNAPSHOTS = Counter("trimtab_snapshots_published_total", "Snapshots published (content changed)")
SNAPSHOT_REJECTED = Counter("trimtab_snapshots_rejected_total",
                            "Snapshots refused as inconsistent (the last good one stays)")
TICK_SECONDS = Histogram("trimtab_tick_duration_seconds",
                         "One telemetry tick: scrape, weigh, build and publish",
                         buckets=_LATENCY_BUCKETS)
SCRAPE_ERRORS = Counter("trimtab_telemetry_errors_total",
                        "Failed or partly rejected telemetry reads, by pool", ["pool"])
CONVERGENCE_SECONDS = Histogram(
    "trimtab_convergence_seconds",
    "From the telemetry read that changed a ClusterLoadAssignment to the client's ACK of it "
    "(once per ACKed response that carried a change; its oldest)", ["api"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0,
             30.0))


# --- the control loop's decisions -------------------------------------------------------------
SCALE_SCORE = Gauge("trimtab_pool_scale_score", "Dual-metric scale score of a pool", ["pool"])
DESIRED_REPLICAS = Gauge("trimtab_pool_desired_replicas", "Replicas the autoscaler asks for",
                         ["pool"])
ROLLOUT_PERCENT = Gauge("trimtab_rollout_canary_percent", "Traffic share of a pool's canary",
                        ["pool"])
ROLLOUT_EVENTS = Counter("trimtab_rollout_events_total",
                         "Rollout steps, rollbacks, promotions and operator commands",
                         ["pool", "kind"])
LEADER = Gauge("trimtab_leader", "1 while this replica holds the rollout Lease (leads)",
               ["identity"])


class FleetCollector:
    """Per-endpoint and per-pool series from ``weights()`` (cluster -> its weights), at
    scrape time. The ``pool`` label is the cluster (a canary has its own)."""

    def __init__(self, weights: Callable[[], Mapping[str, PoolWeights]]) -> None:
        self._weights = weights

    def describe(self) -> list[Metric]:
        return []  # series exist only while their endpoints do: nothing to declare up front

    def collect(self) -> Iterator[Metric]:
        weights = self._weights()  # replaced whole by each tick, never mutated: one view
        weight = GaugeMetricFamily("trimtab_endpoint_weight", "Current load_balancing_weight",
                                   labels=["pool", "endpoint"])
        stale = GaugeMetricFamily("trimtab_endpoint_stale",
                                  "1 while an endpoint's telemetry is stale",
                                  labels=["pool", "endpoint"])
        signal = GaugeMetricFamily("trimtab_endpoint_signal",
                                   "Current telemetry input of an endpoint",
                                   labels=["pool", "endpoint", "signal"])
        stale_count = GaugeMetricFamily("trimtab_stale_endpoints",
                                        "Endpoints with stale telemetry", labels=["pool"])
        fail_static = GaugeMetricFamily(
            "trimtab_pool_fail_static",
            "1 while a pool holds its last weights because all telemetry is lost",
            labels=["pool"])
        for pool, pw in sorted(weights.items()):
            stale_here = 0
            for address, ew in pw.endpoints.items():
                weight.add_metric([pool, address], ew.weight)
                stale.add_metric([pool, address], int(ew.stale))
                stale_here += ew.stale
                for name, value in ew.signals.items():
                    signal.add_metric([pool, address, name], value)
            stale_count.add_metric([pool], stale_here)
            fail_static.add_metric([pool], int(pw.fail_static))
        yield from (weight, stale, signal, stale_count, fail_static)


class _Global:
    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


class Collector(Protocol):
    def collect(self) -> Iterator[Metric]: ...


def exposition(fleet: FleetCollector, *others: Collector) -> bytes:
    """The /metrics page: every metric of the global registry, then the fleet's series, then
    those of ``others`` (e.g. Envoy's load reports: `xds/lrs.py`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Global())
    registry.register(fleet)
    for other in others:
        registry.register(other)  # type: ignore[arg-type]
    return generate_latest(registry)
