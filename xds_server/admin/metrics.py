"""Prometheus metrics (prometheus-client). Every name is documented in docs/metrics.md."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0)

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
ENDPOINT_WEIGHT = Gauge("trimtab_endpoint_weight", "Current load_balancing_weight",
                        ["pool", "endpoint"])
ENDPOINT_SIGNAL = Gauge("trimtab_endpoint_signal", "Current telemetry input of an endpoint",
                        ["pool", "endpoint", "signal"])
ENDPOINT_STALE = Gauge("trimtab_endpoint_stale", "1 while an endpoint's telemetry is stale",
                       ["pool", "endpoint"])
STALE_ENDPOINTS = Gauge("trimtab_stale_endpoints", "Endpoints with stale telemetry", ["pool"])
POOL_FAIL_STATIC = Gauge("trimtab_pool_fail_static",
                         "1 while a pool holds its last weights because all telemetry is lost",
                         ["pool"])
CONVERGENCE_SECONDS = Histogram(
    "trimtab_convergence_seconds",
    "From the telemetry read that changed a ClusterLoadAssignment to the client's ACK of it "
    "(once per ACKed response that carried a change; its oldest)", ["api"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0,
             30.0))
