"""Envoy's load reports (LRS): what each Envoy admitted and refused, per cluster, with no
per-request hop.

Envoy's bootstrap (`cluster_manager.load_stats_config`) opens one
`envoy.service.load_stats.v3.LoadReportingService/StreamLoadStats` stream to trimtab's xDS
port. trimtab answers its first request with `send_all_clusters` and a reporting interval (the
tick interval); from then on Envoy sends, every interval, each cluster's counts *for that
interval*: `total_dropped_requests` (measured against Envoy 1.40: every request its circuit
breaker refused, response flag UO, `cluster.<c>.upstream_rq_active_overflow`, is counted
here) and, per locality, `total_issued_requests` (requests sent upstream: admitted),
`total_requests_in_progress` (a level, not a count) and the successes and errors (a refused
request is counted as an error too, without being issued). trimtab also asks for
`report_endpoint_granularity`: each locality's `upstream_endpoint_stats` then carry the same
counts per endpoint, which the status page shows beside each weight (a dead endpoint shows
its errors, not an idle weight 100); only each open stream's latest report of them is kept.

Three parts, as in the xDS streams:

* :class:`LoadReportStream`, sans-IO, one per stream: checks every peer field of a report
  against :class:`ReportLimits` before keeping anything (over a bound: a
  :class:`~xds_server.xds.machine.limits.ProtocolError` naming the field, its size and the
  bound; the stream ends, the peer's fault) and turns it into a :class:`Report`.
* :class:`EnvoyLoad`, the sums across every Envoy: cumulative issued and dropped per
  cluster, and each stream's latest in-progress level and rates. Only clusters trimtab serves
  to that stream are kept (a report's other clusters are counted as ignored, never stored),
  so what it holds is bounded by the config times the open streams (themselves bounded by
  `xds.limits.max_streams`), whatever peers send.
* :class:`LoadReportServicer`, the grpc.aio pump around them, registered on the xDS server
  (`app.py`), behind the same TLS, node authorisation and request rate limit as ADS.

Per priority and per tenant are not in LRS: Envoy's own stats have them
(`cluster.<c>.circuit_breakers.{default,high}.rq_open`,
`<prefix>.http_local_rate_limit.rate_limited`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2
from google.protobuf import duration_pb2
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xds_server.security.guard import Denied, XdsGuard
from xds_server.xds import type_urls
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.machine.bounds import check_node, check_text
from xds_server.xds.machine.limits import FieldLimits, ProtocolError, ResourceLimitExceeded
from xds_server.xds.peer_text import shown

log = logging.getLogger("trimtab.xds.lrs")

SERVICE = "envoy.service.load_stats.v3.LoadReportingService"
METHOD = "StreamLoadStats"
STALE_INTERVALS = 3  # a stream's rates count until this many intervals pass without a report


@dataclass(frozen=True)
class ReportLimits:
    """What one load report may hold; over a bound the stream ends, the peer's fault. A
    report's size in bytes is bounded before parsing by the gRPC server's receive limit
    (`xds.limits.max_request_bytes`, as for every request on the xDS port)."""

    cluster_name: int = 1024  # bytes of each cluster_name and cluster_service_name
    max_clusters: int = 16_384  # cluster_stats per report
    max_localities: int = 16_384  # upstream_locality_stats per report, all clusters
    max_endpoints: int = 65_536  # upstream_endpoint_stats per report, all clusters
    max_count: int = 1_000_000_000  # each count of a report (one interval's requests)
    max_interval_s: float = 86_400.0  # a cluster's load_report_interval
    fields: FieldLimits = field(default_factory=FieldLimits)  # the node's, as on ADS

    def __post_init__(self) -> None:
        for name in ("cluster_name", "max_clusters", "max_localities", "max_endpoints",
                     "max_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class EndpointLoad:
    """One endpoint's counts over one interval of one Envoy's report (trimtab asks for
    ``report_endpoint_granularity``): what Envoy sent it, what failed, what is in flight."""

    issued: int = 0
    errors: int = 0
    in_progress: int = 0


@dataclass(frozen=True)
class ClusterLoad:
    """One cluster's counts over one interval of one Envoy's report."""

    issued: int = 0
    dropped: int = 0
    in_progress: int = 0  # a level at the end of the interval
    interval_s: float = 0.0
    endpoints: Mapping[str, EndpointLoad] = field(default_factory=dict)  # "ip:port" ->


@dataclass(frozen=True)
class Report:
    """One load report, checked: cluster -> its load (a cluster named twice is summed)."""

    clusters: Mapping[str, ClusterLoad]


def _over(what: str, count: int, limit: int) -> ResourceLimitExceeded:
    return ResourceLimitExceeded(f"{what} is {count}; this server accepts at most {limit} "
                                 f"(the xDS port's bound on load reports, docs/security.md)")


class LoadReportStream:
    """One LRS stream's state, sans-IO: `receive(request)` checks a report and returns it;
    `response()` is what to answer the first request with (None after that)."""

    def __init__(self, interval_s: float, limits: ReportLimits | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.limits = limits if limits is not None else ReportLimits()
        self.node_id: str | None = None  # from the first request, checked
        self.node: object | None = None
        self.reports = 0
        self._answered = False

    def receive(self, request: lrs_pb2.LoadStatsRequest) -> Report:
        """Check `request` against the limits (raising ProtocolError, the peer's fault) and
        return its counts. Only the first request's node is checked and kept."""
        limits = self.limits
        if self.node_id is None:
            if not request.HasField("node"):
                raise ProtocolError("the first load report carries no node")
            check_node(request.node, limits.fields)
            self.node_id, self.node = request.node.id, request.node
        stats = request.cluster_stats
        if len(stats) > limits.max_clusters:
            raise _over("cluster_stats per load report", len(stats), limits.max_clusters)
        localities = sum(len(c.upstream_locality_stats) for c in stats)
        if localities > limits.max_localities:
            raise _over("upstream_locality_stats per load report", localities,
                        limits.max_localities)
        endpoints = sum(len(loc.upstream_endpoint_stats)
                        for c in stats for loc in c.upstream_locality_stats)
        if endpoints > limits.max_endpoints:
            raise _over("upstream_endpoint_stats per load report", endpoints,
                        limits.max_endpoints)
        out: dict[str, ClusterLoad] = {}
        for cluster in stats:
            check_text("cluster_stats.cluster_name", cluster.cluster_name, limits.cluster_name)
            check_text("cluster_stats.cluster_service_name", cluster.cluster_service_name,
                       limits.cluster_name)
            load = self._cluster(cluster)
            before = out.get(cluster.cluster_name)
            if before is not None:
                load = ClusterLoad(before.issued + load.issued, before.dropped + load.dropped,
                                   before.in_progress + load.in_progress,
                                   max(before.interval_s, load.interval_s),
                                   _sum_endpoints(before.endpoints, load.endpoints))
            out[cluster.cluster_name] = load
        self.reports += 1
        return Report(out)

    def _cluster(self, cluster: load_report_pb2.ClusterStats) -> ClusterLoad:
        limits = self.limits
        name = cluster.cluster_name

        def count(what: str, value: int) -> int:
            if value > limits.max_count:
                raise ProtocolError(f"{what} of cluster {shown(name)} is {value}; this server "
                                    f"accepts at most {limits.max_count} per report (the xDS "
                                    f"port's bound on load reports, docs/security.md)")
            return value

        dropped = count("total_dropped_requests", cluster.total_dropped_requests)
        issued = in_progress = 0
        endpoints: dict[str, EndpointLoad] = {}
        for locality in cluster.upstream_locality_stats:
            issued += count("total_issued_requests", locality.total_issued_requests)
            in_progress += count("total_requests_in_progress",
                                 locality.total_requests_in_progress)
            for stats in locality.upstream_endpoint_stats:
                socket = stats.address.socket_address
                if not socket.address:
                    continue  # not an IP:port (a pipe): nothing trimtab publishes
                check_text("upstream_endpoint_stats.address", socket.address,
                           limits.cluster_name)
                key = f"{socket.address}:{socket.port_value}"
                was = endpoints.get(key, EndpointLoad())
                endpoints[key] = EndpointLoad(
                    was.issued + count("total_issued_requests", stats.total_issued_requests),
                    was.errors + count("total_error_requests", stats.total_error_requests),
                    was.in_progress + count("total_requests_in_progress",
                                            stats.total_requests_in_progress))
        interval = cluster.load_report_interval
        seconds = interval.seconds + interval.nanos / 1e9
        if not 0 <= seconds <= limits.max_interval_s:
            raise ProtocolError(f"load_report_interval of cluster {shown(name)} is "
                                f"{seconds:g} s; this server accepts 0 to "
                                f"{limits.max_interval_s:g} (docs/security.md)")
        return ClusterLoad(issued, dropped, in_progress, seconds, endpoints)

    def response(self) -> lrs_pb2.LoadStatsResponse | None:
        """The answer to the first report (every cluster, every `interval_s`); then None."""
        if self._answered or self.node_id is None:
            return None
        self._answered = True
        whole = int(self.interval_s)
        return lrs_pb2.LoadStatsResponse(
            send_all_clusters=True, report_endpoint_granularity=True,
            load_reporting_interval=duration_pb2.Duration(
                seconds=whole, nanos=int(round((self.interval_s - whole) * 1e9))))


def _sum_endpoints(a: Mapping[str, EndpointLoad], b: Mapping[str, EndpointLoad]
                  ) -> dict[str, EndpointLoad]:
    out = dict(a)
    for address, load in b.items():
        was = out.get(address)
        out[address] = load if was is None else EndpointLoad(
            was.issued + load.issued, was.errors + load.errors,
            was.in_progress + load.in_progress)
    return out


@dataclass(frozen=True)
class EndpointView:
    """An endpoint's load across the Envoys reporting now: requests in flight and the rates
    of their latest reports (per second)."""

    in_progress: int
    issued_per_s: float
    errors_per_s: float
    envoys: int  # fresh reports that named the endpoint


@dataclass(frozen=True)
class ClusterView:
    """A cluster's load across every Envoy: cumulative counts, the latest in-progress level
    and the rates of the latest reports (per second)."""

    issued: int
    dropped: int
    in_progress: int
    issued_per_s: float
    dropped_per_s: float
    envoys: int  # streams whose latest report named the cluster and is not stale
    endpoints: Mapping[str, EndpointView] = field(default_factory=dict)  # "ip:port" ->


@dataclass
class _Latest:
    at: float
    load: ClusterLoad


class EnvoyLoad:
    """Load reports summed per cluster across every Envoy. Holds only clusters the reporting
    stream is served (``known`` at each report): per cluster two cumulative counts, and per
    open stream its latest load per cluster."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.issued: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.ignored = 0  # cluster stats of clusters trimtab does not serve that stream
        self.reports = 0
        self.refused = 0  # streams ended for a report over a bound
        self._latest: dict[int, dict[str, _Latest]] = {}
        self._ids = itertools.count()

    def open(self) -> int:
        key = next(self._ids)
        self._latest[key] = {}
        return key

    def close(self, key: int) -> None:
        self._latest.pop(key, None)

    @property
    def streams(self) -> int:
        return len(self._latest)

    def add(self, key: int, report: Report, known: Collection[str]) -> None:
        """Count `report` from stream `key`, keeping only the clusters in `known`."""
        now = self.clock()
        latest = self._latest.setdefault(key, {})
        self.reports += 1
        for name, load in report.clusters.items():
            if name not in known:
                self.ignored += 1
                continue
            self.issued[name] = self.issued.get(name, 0) + load.issued
            self.dropped[name] = self.dropped.get(name, 0) + load.dropped
            latest[name] = _Latest(now, load)
        for name in [name for name in latest if name not in known]:
            del latest[name]

    def prune(self, known: Collection[str]) -> None:
        """Forget the counts of clusters trimtab no longer serves."""
        for counts in (self.issued, self.dropped):
            for name in [name for name in counts if name not in known]:
                del counts[name]

    def view(self, stale_after_s: float) -> dict[str, ClusterView]:
        """Every counted cluster's view; a stream's latest report older than
        `stale_after_s` adds nothing to the levels and rates."""
        now = self.clock()
        levels: dict[str, list[float]] = {}
        hosts: dict[str, dict[str, list[float]]] = {}
        for latest in self._latest.values():
            for name, entry in latest.items():
                if now - entry.at > stale_after_s:
                    continue
                load = entry.load
                span = max(load.interval_s, 1e-3)
                row = levels.setdefault(name, [0, 0.0, 0.0, 0])
                row[0] += load.in_progress
                row[1] += load.issued / span
                row[2] += load.dropped / span
                row[3] += 1
                for address, one in load.endpoints.items():
                    host = hosts.setdefault(name, {}).setdefault(address, [0, 0.0, 0.0, 0])
                    host[0] += one.in_progress
                    host[1] += one.issued / span
                    host[2] += one.errors / span
                    host[3] += 1
        out = {}
        for name in sorted(self.issued.keys() | levels.keys()):
            row = levels.get(name, [0, 0.0, 0.0, 0])
            endpoints = {address: EndpointView(int(h[0]), h[1], h[2], int(h[3]))
                         for address, h in sorted(hosts.get(name, {}).items())}
            out[name] = ClusterView(self.issued.get(name, 0), self.dropped.get(name, 0),
                                    int(row[0]), row[1], row[2], int(row[3]), endpoints)
        return out


class LoadCollector:
    """`trimtab_envoy_requests_total{cluster,outcome}` and
    `trimtab_envoy_requests_in_progress{cluster}`, rendered from an :class:`EnvoyLoad` at
    scrape time (a cluster trimtab stops serving loses its series)."""

    def __init__(self, load: EnvoyLoad, stale_after_s: Callable[[], float]) -> None:
        self.load = load
        self.stale_after_s = stale_after_s

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "trimtab_envoy_requests",
            "Requests Envoy issued to a cluster (admitted) or dropped (refused: its circuit "
            "breaker's overflows), summed over every Envoy's load reports (LRS)",
            labels=["cluster", "outcome"])
        in_progress = GaugeMetricFamily(
            "trimtab_envoy_requests_in_progress",
            "Requests in flight to a cluster across the Envoys, at their latest load reports",
            labels=["cluster"])
        reports = CounterMetricFamily("trimtab_envoy_load_reports",
                                      "Load reports (LRS) received, by what became of them",
                                      labels=["outcome"])
        load = self.load
        for name, view in load.view(self.stale_after_s()).items():
            requests.add_metric([name, "issued"], view.issued)
            requests.add_metric([name, "dropped"], view.dropped)
            in_progress.add_metric([name], view.in_progress)
        reports.add_metric(["counted"], load.reports)
        reports.add_metric(["refused"], load.refused)
        yield from (requests, in_progress, reports)


class LoadReportServicer:
    """The LRS gRPC service: pumps reports from the stream into :class:`LoadReportStream`
    and :class:`EnvoyLoad`. `interval_s()` is read when a stream opens; the clusters a
    stream may report on are those of its snapshot (its node's view under the guard)."""

    def __init__(self, cache: SnapshotCache, load: EnvoyLoad,
                 interval_s: Callable[[], float], guard: XdsGuard | None = None,
                 limits: ReportLimits | None = None) -> None:
        self.cache = cache
        self.load = load
        self.interval_s = interval_s
        self.guard = guard
        self.limits = limits if limits is not None else ReportLimits()
        self._closing = asyncio.Event()

    def close_streams(self) -> None:
        """Shutting down: end every open stream now (Envoy reconnects, e.g. to a replica)."""
        self._closing.set()

    def handlers(self) -> list[grpc.GenericRpcHandler]:
        method = grpc.stream_stream_rpc_method_handler(
            self.stream, request_deserializer=lrs_pb2.LoadStatsRequest.FromString,
            response_serializer=lrs_pb2.LoadStatsResponse.SerializeToString)
        return [grpc.method_handlers_generic_handler(SERVICE, {METHOD: method})]

    def known(self, snapshot: object) -> Collection[str]:
        if snapshot is None:
            return frozenset()
        return snapshot.names_of(type_urls.CLUSTER)  # type: ignore[attr-defined]

    async def stream(self, requests: AsyncIterator[lrs_pb2.LoadStatsRequest],
                     context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[lrs_pb2.LoadStatsResponse]:
        machine = LoadReportStream(self.interval_s(), self.limits)
        access = self.guard.open(context) if self.guard is not None else None
        key = self.load.open()
        try:
            async for request in _until(requests, self._closing):
                if self.guard is not None and access is not None:
                    self.guard.on_request(access)
                report = machine.receive(request)
                snapshot = self.cache.snapshot
                if self.guard is not None and access is not None:
                    self.guard.admit(access, machine.node)  # type: ignore[arg-type]
                    snapshot = self.guard.view(access, snapshot)
                self.load.add(key, report, self.known(snapshot))
                del request, report
                response = machine.response()
                if response is not None:
                    log.info("load reports from %s (node %s) every %g s", context.peer(),
                             shown(machine.node_id or ""), machine.interval_s)
                    yield response
        except ProtocolError as exc:
            self.load.refused += 1
            log.warning("ending load report stream from %s (node %s): %s", context.peer(),
                        shown(machine.node_id or ""), exc)
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, ResourceLimitExceeded)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(code, str(exc))
        except Denied as exc:  # the guard has logged and counted it
            await context.abort(exc.code, exc.reason)
        finally:
            self.load.close(key)
            self.load.prune(self.known(self.cache.snapshot))


async def _until(requests: AsyncIterator[lrs_pb2.LoadStatsRequest], stop: asyncio.Event
                 ) -> AsyncIterator[lrs_pb2.LoadStatsRequest]:
    """`requests` until the peer ends them (or breaks the stream) or `stop` is set."""
    iterator = aiter(requests)
    stopping = asyncio.ensure_future(stop.wait())
    following: asyncio.Future | None = None
    try:
        while not stop.is_set():
            following = asyncio.ensure_future(anext(iterator))
            await asyncio.wait((following, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                return
            try:
                request = following.result()
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001 - any read failure just ends the stream
                log.debug("load report stream closed by peer: %r", exc)
                return
            yield request
    finally:
        stopping.cancel()
        if following is not None and not following.done():  # stopped, or we were cancelled
            following.cancel()
            with contextlib.suppress(BaseException):  # its end, whatever it is, is retrieved
                await following

