"""Envoy's load reports (xds/lrs.py): every peer field bounded, reports summed per cluster
across Envoys, and the gRPC pump that ends a hostile stream with an error naming the bound."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import grpc
import pytest
from envoy.config.endpoint.v3 import load_report_pb2
from envoy.service.load_stats.v3 import lrs_pb2
from google.protobuf import duration_pb2

from xds_server.xds import type_urls
from xds_server.xds.lrs import (
    METHOD,
    SERVICE,
    ClusterLoad,
    EndpointLoad,
    EnvoyLoad,
    LoadCollector,
    LoadReportServicer,
    LoadReportStream,
    Report,
    ReportLimits,
)
from xds_server.xds.machine.limits import FieldTooLarge, ProtocolError, ResourceLimitExceeded


def _cluster(name: str, issued: int = 0, dropped: int = 0, in_progress: int = 0,
             localities: int = 1, endpoints: int = 0,
             interval_s: float = 1.0) -> load_report_pb2.ClusterStats:
    stats = load_report_pb2.ClusterStats(cluster_name=name, total_dropped_requests=dropped)
    whole = int(interval_s)
    stats.load_report_interval.CopyFrom(
        duration_pb2.Duration(seconds=whole, nanos=int((interval_s - whole) * 1e9)))
    for index in range(localities):
        locality = stats.upstream_locality_stats.add()
        if index == 0:
            locality.total_issued_requests = issued
            locality.total_requests_in_progress = in_progress
        for _ in range(endpoints):
            locality.upstream_endpoint_stats.add(total_issued_requests=1)
    return stats


def _request(*clusters: load_report_pb2.ClusterStats,
             node_id: str | None = "envoy-1") -> lrs_pb2.LoadStatsRequest:
    request = lrs_pb2.LoadStatsRequest(cluster_stats=clusters)
    if node_id is not None:
        request.node.id = node_id
    return request


# -- LoadReportStream: the bounds ------------------------------------------------------------


def test_first_report_is_answered_with_every_cluster_and_the_interval() -> None:
    stream = LoadReportStream(0.5)
    report = stream.receive(_request())
    assert report.clusters == {}
    response = stream.response()
    assert response is not None and response.send_all_clusters
    assert response.report_endpoint_granularity  # per-endpoint counts for the status page
    assert response.load_reporting_interval.ToTimedelta().total_seconds() == 0.5
    assert stream.response() is None  # answered once


def test_a_report_sums_localities_and_repeated_clusters() -> None:
    stream = LoadReportStream(1.0)
    report = stream.receive(_request(_cluster("a", issued=3, dropped=7, in_progress=3),
                                     _cluster("a", issued=2, in_progress=1, interval_s=2.0),
                                     _cluster("b", dropped=1)))
    assert report.clusters["a"] == ClusterLoad(5, 7, 4, 2.0)
    assert report.clusters["b"] == ClusterLoad(0, 1, 0, 1.0)


def test_the_first_report_must_carry_a_node_and_only_its_node_is_checked() -> None:
    with pytest.raises(ProtocolError, match="carries no node"):
        LoadReportStream(1.0).receive(_request(node_id=None))
    stream = LoadReportStream(1.0)
    stream.receive(_request())
    stream.receive(_request(node_id="x" * 5000))  # later nodes are ignored (Envoy repeats it)
    assert stream.node_id == "envoy-1"


def test_a_node_id_over_its_bound_is_refused_naming_it() -> None:
    with pytest.raises(FieldTooLarge, match=r"node.id is 2000 bytes; this server accepts at "
                                            r"most 1024"):
        LoadReportStream(1.0).receive(_request(node_id="n" * 2000))


def test_a_cluster_name_over_1_kib_is_refused_naming_the_field() -> None:
    with pytest.raises(FieldTooLarge, match=r"cluster_stats.cluster_name is 1025 bytes; this "
                                            r"server accepts at most 1024"):
        LoadReportStream(1.0).receive(_request(_cluster("c" * 1025)))
    LoadReportStream(1.0).receive(_request(_cluster("c" * 1024)))  # at the bound: kept


@pytest.mark.parametrize(("limits", "clusters", "message"), [
    (ReportLimits(max_clusters=2), [_cluster("a"), _cluster("b"), _cluster("c")],
     "cluster_stats per load report is 3; this server accepts at most 2"),
    (ReportLimits(max_localities=3), [_cluster("a", localities=2), _cluster("b", localities=2)],
     "upstream_locality_stats per load report is 4; this server accepts at most 3"),
    (ReportLimits(max_endpoints=5), [_cluster("a", localities=2, endpoints=3)],
     "upstream_endpoint_stats per load report is 6; this server accepts at most 5"),
])
def test_counts_of_entries_over_their_bounds_are_refused(limits, clusters, message) -> None:
    with pytest.raises(ResourceLimitExceeded, match=message):
        LoadReportStream(1.0, limits).receive(_request(*clusters))


def test_default_bounds_hold_a_hostile_report() -> None:
    limits = ReportLimits()
    many = [_cluster(f"c{i}", localities=0) for i in range(limits.max_clusters + 1)]
    with pytest.raises(ResourceLimitExceeded, match="at most 16384"):
        LoadReportStream(1.0).receive(_request(*many))


def test_a_count_or_interval_out_of_range_is_refused_with_the_name_escaped() -> None:
    with pytest.raises(ProtocolError, match=r"total_dropped_requests of cluster 'a\\nb' is "
                                            r"1000000001; this server accepts at most"):
        LoadReportStream(1.0).receive(_request(_cluster("a\nb", dropped=10**9 + 1)))
    with pytest.raises(ProtocolError, match="total_issued_requests"):
        LoadReportStream(1.0).receive(_request(_cluster("a", issued=2**64 - 1)))
    with pytest.raises(ProtocolError, match="load_report_interval of cluster 'a' is -5 s"):
        LoadReportStream(1.0).receive(_request(_cluster("a", interval_s=-5.0)))


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_clusters"):
        ReportLimits(max_clusters=0)
    with pytest.raises(ValueError, match="interval_s"):
        LoadReportStream(0.0)


# -- EnvoyLoad: the sums ------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_are_summed_per_cluster_across_envoys() -> None:
    clock = _Clock()
    load = EnvoyLoad(clock)
    one, two = load.open(), load.open()
    known = {"adm", "other"}
    load.add(one, Report({"adm": ClusterLoad(3, 7, 3, 1.0)}), known)
    load.add(two, Report({"adm": ClusterLoad(2, 1, 2, 2.0), "xds_cluster": ClusterLoad(1)}),
             known)
    load.add(one, Report({"adm": ClusterLoad(4, 0, 1, 1.0)}), known)
    view = load.view(stale_after_s=3.0)
    assert set(view) == {"adm"} and load.ignored == 1  # not served: counted, never kept
    adm = view["adm"]
    assert (adm.issued, adm.dropped) == (9, 8)
    assert adm.in_progress == 1 + 2  # each stream's latest level
    assert adm.issued_per_s == pytest.approx(4 / 1.0 + 2 / 2.0)
    assert adm.dropped_per_s == pytest.approx(0 + 1 / 2.0)
    assert adm.envoys == 2


def test_stale_and_closed_streams_drop_out_of_levels_but_not_totals() -> None:
    clock = _Clock()
    load = EnvoyLoad(clock)
    one, two = load.open(), load.open()
    load.add(one, Report({"adm": ClusterLoad(1, 1, 5, 1.0)}), {"adm"})
    clock.now += 10
    load.add(two, Report({"adm": ClusterLoad(2, 0, 1, 1.0)}), {"adm"})
    assert load.view(3.0)["adm"].in_progress == 1  # the first stream's report is stale
    load.close(two)
    view = load.view(3.0)["adm"]
    assert (view.issued, view.dropped, view.in_progress, view.envoys) == (3, 1, 0, 0)
    assert load.streams == 1


def test_clusters_no_longer_served_are_forgotten() -> None:
    load = EnvoyLoad(_Clock())
    key = load.open()
    load.add(key, Report({"a": ClusterLoad(1), "b": ClusterLoad(1)}), {"a", "b"})
    load.add(key, Report({"a": ClusterLoad(1)}), {"a"})  # b gone from this stream's view
    load.prune({"a"})
    assert set(load.view(3.0)) == {"a"} and load.issued == {"a": 2}


def test_the_metrics_render_the_sums() -> None:
    load = EnvoyLoad(_Clock())
    key = load.open()
    load.add(key, Report({"adm": ClusterLoad(22, 8, 22, 0.5)}), {"adm"})
    families = {f.name: f for f in LoadCollector(load, lambda: 3.0).collect()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("trimtab_envoy_requests_total",
                    (("cluster", "adm"), ("outcome", "issued")))] == 22
    assert samples[("trimtab_envoy_requests_total",
                    (("cluster", "adm"), ("outcome", "dropped")))] == 8
    assert samples[("trimtab_envoy_requests_in_progress", (("cluster", "adm"),))] == 22
    assert samples[("trimtab_envoy_load_reports_total", (("outcome", "counted"),))] == 1


# -- the gRPC pump ------------------------------------------------------------------------------


class _Snapshot:
    def __init__(self, clusters: set[str]) -> None:
        self.clusters = frozenset(clusters)

    def names_of(self, type_url: str) -> frozenset[str]:
        return self.clusters if type_url == type_urls.CLUSTER else frozenset()


async def _serve(load: EnvoyLoad, body) -> None:
    cache = SimpleNamespace(snapshot=_Snapshot({"adm"}))
    servicer = LoadReportServicer(cache, load, lambda: 0.25)  # type: ignore[arg-type]
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(tuple(servicer.handlers()))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(
                f"/{SERVICE}/{METHOD}",
                request_serializer=lrs_pb2.LoadStatsRequest.SerializeToString,
                response_deserializer=lrs_pb2.LoadStatsResponse.FromString)
            await body(call, servicer)
    finally:
        await server.stop(None)


def test_a_stream_is_answered_and_its_reports_counted() -> None:
    load = EnvoyLoad()

    async def body(call, servicer) -> None:
        stream = call()
        await stream.write(_request())
        response = await stream.read()
        assert response.send_all_clusters
        assert response.load_reporting_interval.ToTimedelta().total_seconds() == 0.25
        await stream.write(_request(_cluster("adm", issued=3, dropped=7)))
        for _ in range(200):
            if load.issued.get("adm"):
                break
            await asyncio.sleep(0.01)
        assert (load.issued, load.dropped) == ({"adm": 3}, {"adm": 7})
        servicer.close_streams()  # shutting down ends the stream at once
        await asyncio.wait_for(stream.done_writing(), 5)
        assert (await asyncio.wait_for(stream.code(), 5)) == grpc.StatusCode.OK
        assert load.streams == 0
    asyncio.run(_serve(load, body))


def test_a_hostile_report_ends_its_stream_naming_the_bound_and_logs_it_escaped(caplog) -> None:
    load = EnvoyLoad()
    caplog.set_level(logging.WARNING, "trimtab.xds.lrs")

    async def body(call, servicer) -> None:
        stream = call()
        await stream.write(_request(node_id="evil\nINFO forged line"))
        await stream.read()
        await stream.write(_request(_cluster("c" * 5000)))
        assert (await stream.code()) == grpc.StatusCode.INVALID_ARGUMENT
        assert "cluster_stats.cluster_name is 5000 bytes; this server accepts at most 1024" in (
            await stream.details())
        many = call()
        await many.write(_request(*[_cluster(f"c{i}", localities=0) for i in range(16_385)]))
        assert (await many.code()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    asyncio.run(_serve(load, body))
    assert load.refused == 2 and load.issued == {} and load.streams == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("'evil\\nINFO forged line'" in line for line in lines), lines
    assert not any("\n" in line for line in lines)


def test_per_endpoint_counts_are_kept_per_stream_and_summed_across_envoys() -> None:
    """Issue 25 item 3: what each Envoy sent each endpoint (upstream_endpoint_stats), so the
    status page can show a dead endpoint's errors next to its weight."""
    stats = _cluster("adm", issued=5, in_progress=2, interval_s=2.0)
    for host, issued, errors, in_progress in (("10.0.0.1", 4, 0, 2), ("10.0.0.2", 1, 1, 0)):
        endpoint = stats.upstream_locality_stats[0].upstream_endpoint_stats.add(
            total_issued_requests=issued, total_error_requests=errors,
            total_requests_in_progress=in_progress)
        endpoint.address.socket_address.address = host
        endpoint.address.socket_address.port_value = 8000
    stats.upstream_locality_stats[0].upstream_endpoint_stats.add(total_issued_requests=9)  # no address
    report = LoadReportStream(1.0).receive(_request(stats))
    assert report.clusters["adm"].endpoints == {
        "10.0.0.1:8000": EndpointLoad(4, 0, 2), "10.0.0.2:8000": EndpointLoad(1, 1, 0)}
    clock = _Clock()
    load = EnvoyLoad(clock)
    one, two = load.open(), load.open()
    load.add(one, report, {"adm"})
    load.add(two, Report({"adm": ClusterLoad(1, 0, 1, 1.0, {"10.0.0.1:8000": EndpointLoad(1, 0, 1)})}),
             {"adm"})
    hosts = load.view(stale_after_s=3.0)["adm"].endpoints
    assert hosts["10.0.0.1:8000"].in_progress == 3 and hosts["10.0.0.1:8000"].envoys == 2
    assert hosts["10.0.0.1:8000"].issued_per_s == pytest.approx(4 / 2.0 + 1 / 1.0)
    assert hosts["10.0.0.2:8000"].errors_per_s == pytest.approx(0.5)
    load.close(one)
    assert set(load.view(stale_after_s=3.0)["adm"].endpoints) == {"10.0.0.1:8000"}
