"""Stream observers (xds_server/xds/observers/): the fan-out that keeps a failing observer from
breaking a stream, what reaches each standard observer, and the servicer handing every event
to them over real gRPC (in-process server, no Envoy)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse
from prometheus_client import REGISTRY

from tests.support.wait import wait_until_async
from tests.support.xds_fixtures import BASE, snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.convergence import Convergence
from xds_server.xds.heap import HeapTrimmer
from xds_server.xds.nacks import NackLog
from xds_server.xds.observers import push_log as push_log_module
from xds_server.xds.observers.base import EventCallback, Observers, Sent, StreamObserver
from xds_server.xds.observers.convergence import ConvergenceObserver
from xds_server.xds.observers.metrics import StreamMetrics
from xds_server.xds.observers.push_log import PushLog
from xds_server.xds.observers.stream_log import NACK_DETAIL_LOGGED, StreamLog
from xds_server.xds.protocol import (
    Ack,
    Nack,
    ProtocolError,
    ResourceLimitExceeded,
    Response,
    SotwStream,
    StaleNonce,
    Subscription,
    Withheld,
)
from xds_server.xds.server import XdsServicer, start_xds_server
from xds_server.xds.stream_info import StreamInfo

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


def _stream(node: str = "node-1", api: str = "sotw") -> StreamInfo:
    machine = SotwStream()
    machine.receive(DiscoveryRequest(node={"id": node}, type_url=T.CLUSTER))
    return StreamInfo("ipv4:127.0.0.1:5000", api, "AggregatedDiscoveryService", machine)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Recorder(StreamObserver):
    """Every hook call, as (hook, argument) pairs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_open(self, stream: StreamInfo) -> None:
        self.calls.append(("open", stream))

    def on_subscribe(self, stream: StreamInfo, type_url: str) -> None:
        self.calls.append(("subscribe", type_url))

    def on_event(self, stream: StreamInfo, event: object) -> None:
        self.calls.append(("event", event))

    def on_withheld(self, stream: StreamInfo, notice: Withheld) -> None:
        self.calls.append(("withheld", notice))

    def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
        self.calls.append(("sent", sent))

    def on_error(self, stream: StreamInfo, error: ProtocolError) -> None:
        self.calls.append(("error", error))

    def on_close(self, stream: StreamInfo) -> None:
        self.calls.append(("close", stream))

    def of(self, hook: str) -> list[object]:
        return [arg for name, arg in self.calls if name == hook]


class Boom(Recorder):
    """Raises from every hook (after recording it)."""

    def __getattribute__(self, name: str):
        hook = object.__getattribute__(self, name)
        if not name.startswith("on_"):
            return hook

        def failing(*args: object) -> None:
            hook(*args)
            raise RuntimeError(f"boom in {name}")
        return failing


# ---- the fan-out --------------------------------------------------------------------------

def test_every_observer_gets_every_hook_in_order() -> None:
    first, second = Recorder(), Recorder()
    order: list[str] = []
    observers = Observers([first, EventCallback(lambda s, e: order.append("callback")), second])
    stream = _stream()
    ack = Ack(T.CLUSTER, "1", "v1")
    observers.on_open(stream)
    observers.on_subscribe(stream, T.CLUSTER)
    observers.on_event(stream, ack)
    observers.on_close(stream)
    for recorder in (first, second):
        assert recorder.calls == [("open", stream), ("subscribe", T.CLUSTER), ("event", ack),
                                  ("close", stream)]
    assert order == ["callback"]
    assert observers.failed == 0


def test_an_observer_is_called_only_on_the_hooks_it_has() -> None:
    class OnlySent:  # duck-typed: no base class, one hook
        def __init__(self) -> None:
            self.sent: list[Sent] = []

        def on_sent(self, stream: StreamInfo, sent: Sent) -> None:
            self.sent.append(sent)

    only = OnlySent()
    observers = Observers([only])  # type: ignore[list-item]
    stream = _stream()
    observers.on_open(stream)
    observers.on_event(stream, StaleNonce(T.CLUSTER, "9"))
    sent = Sent(Response(T.CLUSTER, "v1", "1", ()), 42, 0.001)
    observers.on_sent(stream, sent)
    assert only.sent == [sent]
    assert observers.failed == 0  # the missing hooks were skipped, not called and failed


def test_a_failing_observer_is_logged_and_counted_and_the_others_still_run(caplog) -> None:
    boom, after = Boom(), Recorder()
    observers = Observers([boom, after])
    stream = _stream(node="n-7")
    events = [Ack(T.CLUSTER, str(i), "v1") for i in range(4)]
    metric = "trimtab_xds_observer_failures_total"
    before = REGISTRY.get_sample_value(metric, {"observer": "Boom.on_event"}) or 0.0
    with caplog.at_level(logging.DEBUG, logger="trimtab.xds"):
        for event in events:
            observers.on_event(stream, event)
        observers.on_close(stream)
    assert after.of("event") == events and after.of("close") == [stream]
    assert boom.of("event") == events
    assert observers.failures == {"Boom.on_event": 4, "Boom.on_close": 1}
    assert observers.failed == 5
    assert REGISTRY.get_sample_value(metric, {"observer": "Boom.on_event"}) == before + 4
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    # the first failure of each hook with its traceback, then at 2 and 4 failures
    assert [r.exc_info is not None for r in errors] == [True, False, False, True]
    assert "Boom.on_event" in errors[0].getMessage() and "'n-7'" in errors[0].getMessage()
    assert "failed 2 times" in errors[1].getMessage()
    assert "failed 4 times" in errors[2].getMessage()
    assert "Boom.on_close" in errors[3].getMessage()


# ---- the standard observers ---------------------------------------------------------------

def test_stream_metrics_follow_a_stream() -> None:
    metrics, stream = StreamMetrics(), _stream(api="delta")
    before = {
        "streams": _sample("trimtab_xds_streams", api="delta"),
        "subs": _sample("trimtab_xds_subscriptions", type="eds", api="delta"),
        "acks": _sample("trimtab_xds_acks_total", type="eds"),
        "nacks": _sample("trimtab_xds_nacks_total", type="eds"),
        "stale": _sample("trimtab_xds_stale_nonces_total", type="eds"),
        "pushes": _sample("trimtab_xds_pushes_total", type="eds", api="delta"),
        "bytes": _sample("trimtab_xds_pushed_bytes_total", type="eds"),
        "resources": _sample("trimtab_xds_pushed_resources_total", type="eds"),
        "errors": _sample("trimtab_xds_protocol_errors_total", api="delta"),
    }
    metrics.on_open(stream)
    stream.types.add(T.ENDPOINT)
    metrics.on_subscribe(stream, T.ENDPOINT)
    assert _sample("trimtab_xds_streams", api="delta") == before["streams"] + 1
    assert _sample("trimtab_xds_subscriptions", type="eds", api="delta") == before["subs"] + 1
    metrics.on_event(stream, Ack(T.ENDPOINT, "1", "v1"))
    metrics.on_event(stream, Nack(T.ENDPOINT, "2", "v1", "bad", {"a": "v2"}))
    metrics.on_event(stream, StaleNonce(T.ENDPOINT, "0"))
    metrics.on_event(stream, Subscription(T.ENDPOINT, False, frozenset({"a"})))  # not counted
    resources = tuple(snapshot(BASE).of_type(T.ENDPOINT).values())
    metrics.on_sent(stream, Sent(Response(T.ENDPOINT, "v1", "3", resources), 1234, 0.002))
    metrics.on_error(stream, ProtocolError("no type_url"))
    metrics.on_close(stream)
    assert _sample("trimtab_xds_acks_total", type="eds") == before["acks"] + 1
    assert _sample("trimtab_xds_nacks_total", type="eds") == before["nacks"] + 1
    assert _sample("trimtab_xds_stale_nonces_total", type="eds") == before["stale"] + 1
    assert _sample("trimtab_xds_pushes_total", type="eds", api="delta") == before["pushes"] + 1
    assert _sample("trimtab_xds_pushed_bytes_total", type="eds") == before["bytes"] + 1234
    assert (_sample("trimtab_xds_pushed_resources_total", type="eds")
            == before["resources"] + len(resources))
    assert _sample("trimtab_xds_protocol_errors_total", api="delta") == before["errors"] + 1
    assert _sample("trimtab_xds_streams", api="delta") == before["streams"]
    assert _sample("trimtab_xds_subscriptions", type="eds", api="delta") == before["subs"]


def test_the_stream_log_reports_nacks_withheld_pushes_once_and_protocol_errors(caplog) -> None:
    log, one, two = StreamLog(), _stream(node="n-1"), _stream(node="n-2")
    notice = Withheld(T.CLUSTER, "v9", ("a", "b"), 5000, 1000)
    with caplog.at_level(logging.INFO, logger="trimtab.xds"):
        log.on_event(one, Nack(T.ENDPOINT, "4", "v1", "x" * 5000, {"a": "v2"}))
        log.on_event(one, Ack(T.ENDPOINT, "5", "v2"))
        log.on_withheld(one, notice)
        log.on_withheld(two, notice)  # the same notice from another stream: not again
        log.on_error(one, ResourceLimitExceeded("too many names"))
        log.on_error(two, ProtocolError("no type_url"))
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    [nack] = [m for level, m in lines if m.startswith("NACK")]
    assert "'n-1'" in nack and "eds nonce 4" in nack and "{'a': 'v2'}" in nack
    assert nack.endswith(f"'{'x' * NACK_DETAIL_LOGGED}'... (3000 more characters)")
    assert "x" * (NACK_DETAIL_LOGGED + 1) not in nack
    withheld = [m for level, m in lines if level == logging.ERROR]
    assert len(withheld) == 1 and "cds a, b (version v9)" in withheld[0]
    assert "5000 bytes" in withheld[0] and "whole-state" in withheld[0]
    assert (logging.WARNING, "ending stream from ipv4:127.0.0.1:5000 (node 'n-1'): "
            "too many names") in lines
    assert (logging.WARNING, "protocol error from ipv4:127.0.0.1:5000 (node 'n-2'): "
            "no type_url") in lines


def test_the_push_log_summarises_above_its_stream_threshold(caplog, monkeypatch) -> None:
    monkeypatch.setattr(push_log_module, "PER_PUSH_LOG_STREAMS", 1)
    response = Response(T.ENDPOINT, "v3", "7", tuple(snapshot(BASE).of_type(T.ENDPOINT).values()))

    async def body() -> None:
        log, one, two = PushLog(window_s=60), _stream(node="n-1"), _stream(node="n-2")
        log.on_open(one)
        log.on_sent(one, Sent(response, 100, 0.001))  # one stream open: its own info line
        log.on_open(two)
        log.on_sent(one, Sent(response, 100, 0.001))  # two open: debug, and the summary
        log.on_sent(two, Sent(response, 150, 0.001))
        log.flush()
        log.on_close(two)
        assert log.open_streams == 1

    with caplog.at_level(logging.DEBUG, logger="trimtab.xds"):
        asyncio.run(body())
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info[0] == "push eds vv3 nonce 7 to 'n-1': 2 resources, 0 removed"
    assert len([m for m in debug if m.startswith("push eds")]) == 2
    [summary] = info[1:]
    assert summary.startswith("pushed eds (sotw) 2 times within 60.0 s: 4 resources")
    assert "250 bytes" in summary and "versions v3" in summary


def test_convergence_is_observed_on_the_ack_of_a_stamped_response() -> None:
    tracker, snap = Convergence(), snapshot(BASE)
    tracker.published(snap, read_at=100.0)
    now = [100.5]
    observer, stream = ConvergenceObserver(tracker, clock=lambda: now[0]), _stream(api="obs")
    eds = tuple(snap.of_type(T.ENDPOINT).values())
    before = _sample("trimtab_convergence_seconds_count", api="obs")
    total = _sample("trimtab_convergence_seconds_sum", api="obs")
    observer.on_open(stream)
    observer.on_sent(stream, Sent(Response(T.ENDPOINT, "v1", "1", eds), 10, 0.0))
    observer.on_sent(stream, Sent(Response(T.ENDPOINT, "v2", "2", eds), 10, 0.0))
    observer.on_event(stream, Nack(T.ENDPOINT, "2", "", "bad", {}))
    observer.on_event(stream, Ack(T.ENDPOINT, "2", "v2"))  # NACKed: nothing to observe
    assert _sample("trimtab_convergence_seconds_count", api="obs") == before
    observer.on_event(stream, Ack(T.ENDPOINT, "1", "v1"))
    assert _sample("trimtab_convergence_seconds_count", api="obs") == before + 1
    assert (_sample("trimtab_convergence_seconds_sum", api="obs")
            == pytest.approx(total + 0.5, abs=1e-9))
    observer.on_close(stream)
    assert observer.streams == {}


def test_the_nack_log_and_the_heap_trimmer_are_observers() -> None:
    nacks, stream = NackLog(clock=lambda: 5.0), _stream(node="envoy-3")
    nacks.on_event(stream, Ack(T.CLUSTER, "1", "v1"))
    nacks.on_event(stream, Nack(T.CLUSTER, "2", "v1", "bad cluster", {"a": "v2"}))
    [record] = nacks.recent()
    assert (record["node"], record["type"], record["detail"], nacks.total) == (
        "envoy-3", "cds", "bad cluster", 1)
    calls: list[int] = []

    async def body() -> None:
        trimmer = HeapTrimmer(min_names=1, delay_s=0.01, trim=lambda pad: calls.append(pad) or 1)
        stream.machine.responses(snapshot(BASE))  # now holds the two clusters it was sent
        trimmer.on_close(stream)
        await wait_until_async(lambda: trimmer.trims, 2.0, "a trim")
        assert trimmer.trims == 1
    asyncio.run(body())
    assert calls == [0]


# ---- the servicer hands every event to the observers ---------------------------------------

@contextlib.asynccontextmanager
async def _ads_stream(servicer: XdsServicer) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """A SotW ADS stream to `servicer`, served in-process on a free port."""
    server, port = await start_xds_server(servicer, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel.stream_stream(
                ADS, request_serializer=DiscoveryRequest.SerializeToString,
                response_deserializer=DiscoveryResponse.FromString)()
    finally:
        await server.stop(None)


def _servicer(observers: list[StreamObserver]) -> XdsServicer:
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(BASE))
    return XdsServicer(cache, observers=observers)


def test_a_failing_observer_never_breaks_a_stream(caplog) -> None:
    """An observer that raises from every hook, placed before all the others: the stream is
    served, ACKed and NACKed as usual, the observers after it see everything, and each hook's
    failures are counted."""
    recorder, boom = Recorder(), Boom()

    async def body() -> None:
        servicer = _servicer([recorder])
        cache = servicer.cache
        servicer.observers = Observers([boom, *servicer.observers.observers])
        pushes = _sample("trimtab_xds_pushes_total", type="cds", api="sotw")
        nacks = _sample("trimtab_xds_nacks_total", type="cds")
        async with _ads_stream(servicer) as call:
            await call.write(DiscoveryRequest(node={"id": "n-1"}, type_url=T.CLUSTER))
            first = await asyncio.wait_for(call.read(), 5)
            await call.write(DiscoveryRequest(type_url=T.CLUSTER, response_nonce=first.nonce,
                                              version_info=first.version_info))
            cache.set_snapshot(snapshot({**BASE, "c": {"10.0.2.1:80": 5}}))
            second = await asyncio.wait_for(call.read(), 5)
            await call.write(DiscoveryRequest(
                type_url=T.CLUSTER, response_nonce=second.nonce,
                version_info=first.version_info, error_detail={"message": "bad cluster"}))
            await wait_until_async(lambda: len(recorder.of("event")) >= 3)
            [info] = servicer.streams
            assert info.machine.types[T.CLUSTER].acked_version == first.version_info
            call.cancel()
            await wait_until_async(lambda: recorder.of("close"))
        sent = recorder.of("sent")
        assert [(s.response.nonce, s.response.version) for s in sent] == [
            (first.nonce, first.version_info), (second.nonce, second.version_info)]
        assert all(s.size > 0 and s.seconds >= 0 for s in sent)
        assert _sample("trimtab_xds_pushes_total", type="cds", api="sotw") == pushes + 2
        assert _sample("trimtab_xds_nacks_total", type="cds") == nacks + 1
        assert servicer.observers.failures == {
            "Boom.on_open": 1, "Boom.on_subscribe": 1, "Boom.on_event": 3, "Boom.on_sent": 2,
            "Boom.on_close": 1}

    with caplog.at_level(logging.ERROR, logger="trimtab.xds"):
        asyncio.run(body())
    assert [call for call, _ in recorder.calls] == [
        "open", "subscribe", "event", "sent", "event", "sent", "event", "close"]
    subscription, ack, nack = recorder.of("event")
    assert isinstance(subscription, Subscription) and subscription.wildcard
    assert isinstance(ack, Ack) and isinstance(nack, Nack)
    assert nack.detail == "bad cluster" and set(nack.rejected) == {"a", "b", "c"}
    assert recorder.of("subscribe") == [T.CLUSTER]
    assert boom.calls == recorder.calls  # it was called with the same, and failed each time
    assert any("Boom.on_open" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_protocol_error_reaches_the_observers_before_the_stream_ends() -> None:
    recorder = Recorder()

    async def body() -> None:
        async with _ads_stream(_servicer([recorder])) as call:
            await call.write(DiscoveryRequest(resource_names=["a"]))  # no type_url on ADS
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await asyncio.wait_for(call.read(), 5)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await wait_until_async(lambda: recorder.of("close"))

    asyncio.run(body())
    assert [call for call, _ in recorder.calls] == ["open", "error", "close"]
    [error] = recorder.of("error")
    assert isinstance(error, ProtocolError) and "type_url" in str(error)
