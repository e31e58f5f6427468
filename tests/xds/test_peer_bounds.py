"""Every peer-supplied string of a DiscoveryRequest / DeltaDiscoveryRequest is bounded at the
protocol edge (the sans-IO machines), and what is logged or kept of it (the stream and push
logs, the NACK log behind /v1/nacks, the metrics' labels) is bounded and escaped."""

from __future__ import annotations

import json
import logging

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DiscoveryRequest
from google.rpc import status_pb2

from tests.support.metrics import sample_value
from tests.support.xds_fixtures import BASE, snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.nacks import NackLog
from xds_server.xds.observers.base import Observers, Sent, StreamObserver
from xds_server.xds.observers.metrics import StreamMetrics
from xds_server.xds.observers.push_log import PushLog
from xds_server.xds.observers.stream_log import StreamLog
from xds_server.xds.protocol import (
    DeltaStream,
    Nack,
    ProtocolError,
    ResourceLimitExceeded,
    SotwStream,
    StreamLimits,
)
from xds_server.xds.stream_info import StreamInfo

MB = 1024 * 1024
HOSTILE = "\n\r\x1b[31mFAKE LOG LINE\u2028\u202e\x00"  # line breaks, escapes, bidi, NUL


def _node(**fields: object) -> base_pb2.Node:
    node = base_pb2.Node(id="edge-1")
    for path, value in fields.items():
        target = node
        *parents, leaf = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if leaf == "metadata":
            target.metadata.fields["blob"].string_value = str(value)
        elif leaf == "extensions":
            for i in range(int(str(value))):
                target.extensions.add(name=f"envoy.filters.http.made_up_{i:06d}",
                                      category="envoy.filters.http")
        else:
            setattr(target, leaf, value)
    return node


def _request(api: str, node: base_pb2.Node | None = None, **fields: object):
    if api == "sotw":
        req = DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a"])
    else:
        req = DeltaDiscoveryRequest(type_url=T.ENDPOINT, resource_names_subscribe=["a"])
    if node is not None:
        req.node.CopyFrom(node)
    for name, value in fields.items():
        if name == "initial":
            for key, version in value.items():  # type: ignore[attr-defined]
                req.initial_resource_versions[key] = version
        elif isinstance(value, list):
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)
    return req


def _machine(api: str, limits: StreamLimits | None = None) -> SotwStream | DeltaStream:
    return SotwStream(limits=limits) if api == "sotw" else DeltaStream(limits=limits)


# ---- each field over its bound ends the stream, naming the field and the bound ----------------

NODE_FIELDS = [  # (field as named in the message, Node field path, value, bound)
    ("node.id", "id", "x" * 8_400_000, 1024),
    ("node.cluster", "cluster", "c" * 1025, 1024),
    ("node.locality.region", "locality__region", "r" * 257, 256),
    ("node.locality.zone", "locality__zone", "z" * 257, 256),
    ("node.locality.sub_zone", "locality__sub_zone", "s" * 257, 256),
    ("node.user_agent_name", "user_agent_name", "envoy" * 100, 256),
    ("node.user_agent_version", "user_agent_version", "1" * 257, 256),
    ("node.metadata (serialised)", "metadata", "m" * 70_000, 64 * 1024),
    ("node (serialised)", "extensions", 5000, 256 * 1024),
]


@pytest.mark.parametrize("api", ["sotw", "delta"])
@pytest.mark.parametrize(("field", "path", "value", "bound"), NODE_FIELDS,
                         ids=[case[0] for case in NODE_FIELDS])
def test_a_node_field_over_its_bound_ends_the_stream_naming_the_field_and_the_bound(
        api, field, path, value, bound):
    machine = _machine(api)
    with pytest.raises(ProtocolError) as refused:
        machine.receive(_request(api, _node(**{path: value})))
    message = str(refused.value)
    assert not isinstance(refused.value, ResourceLimitExceeded)  # INVALID_ARGUMENT, not EXHAUSTED
    assert message.startswith(f"{field} is ") and f"at most {bound} " in message
    if field == "node.id":
        assert message.startswith("node.id is 8400000 bytes; this server accepts at most 1024")
    assert machine.node is None  # nothing of it kept


REQUEST_FIELDS = [  # (api, field as named in the message, request fields)
    ("sotw", "a name in resource_names", {"resource_names": ["n" * 1025]}),
    ("sotw", "type_url", {"type_url": "t" * 257}),
    ("sotw", "version_info", {"version_info": "v" * 1025}),
    ("sotw", "response_nonce", {"response_nonce": "9" * 257}),
    ("delta", "a name in resource_names_subscribe",
     {"resource_names_subscribe": ["b", "n" * 8 * MB]}),
    ("delta", "a name in resource_names_unsubscribe",
     {"resource_names_unsubscribe": ["n" * 1025]}),
    ("delta", "a name in initial_resource_versions", {"initial": {"n" * 1025: "v1"}}),
    ("delta", "a version in initial_resource_versions", {"initial": {"a": "v" * 1025}}),
    ("delta", "type_url", {"type_url": "t" * 257}),
    ("delta", "response_nonce", {"response_nonce": "9" * 257}),
]


@pytest.mark.parametrize(("api", "field", "fields"), REQUEST_FIELDS,
                         ids=[f"{case[0]}-{case[1]}" for case in REQUEST_FIELDS])
def test_a_request_field_over_its_bound_ends_the_stream_naming_the_field_and_the_bound(
        api, field, fields):
    machine = _machine(api)
    with pytest.raises(ProtocolError, match=rf"^{field} is \d+ bytes; this server accepts at "
                                            rf"most \d+ ") as refused:
        machine.receive(_request(api, **fields))
    assert not isinstance(refused.value, ResourceLimitExceeded)
    assert all(not state.names for state in machine.types.values())


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_fields_at_their_bound_are_accepted_counting_utf8_bytes(api):
    at_bound = "é" * 512  # 1,024 bytes in UTF-8
    node = _node(id=at_bound, cluster=at_bound, locality__zone="z" * 256,
                 user_agent_name="envoy", metadata="m" * 60_000, extensions=300)
    machine = _machine(api)
    machine.receive(_request(api, node, type_url="t" * 256))
    assert machine.node is not None and machine.node.id == at_bound
    over = _machine(api)
    with pytest.raises(ProtocolError, match=r"^node.id is 1025 bytes; .* at most 1024 "):
        over.receive(_request(api, _node(id=at_bound + "x")))  # 513 characters


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_nack_detail_over_its_bound_is_kept_truncated_and_still_honoured(api):
    machine = _machine(api)
    machine.receive(_request(api, _node()))
    [response] = machine.responses(snapshot(BASE))
    reply = _request(api, response_nonce=response.nonce)
    reply.error_detail.CopyFrom(status_pb2.Status(code=3, message="é" * 4 * MB))  # 8 MB
    [nack] = [event for event in machine.receive(reply) if isinstance(event, Nack)]
    assert len(nack.detail.encode()) <= 4096 and nack.detail.startswith("é" * 100)
    assert nack.detail.endswith("... [truncated: 8388608 bytes]")
    assert machine.responses(snapshot(BASE)) == []  # the NACKed version is not sent again


# ---- the subscription byte budget ------------------------------------------------------------

def test_a_delta_stream_subscribing_a_new_large_name_per_request_is_refused_once_over_budget():
    machine = DeltaStream(limits=StreamLimits(max_subscription_bytes=64 * 1024))
    accepted = 0
    with pytest.raises(ResourceLimitExceeded) as refused:
        for i in range(1000):
            machine.receive(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                                  resource_names_subscribe=[f"{i:04d}" * 250]))
            accepted += 1
    assert accepted == 65  # 65 names of 1,000 bytes fit 64 KiB; the 66th does not
    assert str(refused.value) == (
        "the stream's subscriptions would hold 66000 bytes of resource names and "
        "initial_resource_versions; this server accepts at most 65536 per stream (the "
        "subscription byte budget, StreamLimits.max_subscription_bytes)")
    assert machine.held_bytes == 65_000


def test_the_budget_is_per_stream_frees_on_unsubscribe_and_counts_initial_resource_versions():
    machine = DeltaStream(limits=StreamLimits(max_subscription_bytes=10_000))
    machine.receive(DeltaDiscoveryRequest(type_url=T.CLUSTER,  # wildcard, holding 4,000 bytes
                                          initial_resource_versions={"k" * 1000: "v" * 1000,
                                                                     "j" * 1000: "w" * 1000}))
    machine.receive(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                          resource_names_subscribe=["a" * 1000, "b" * 1000]))
    assert machine.held_bytes == 6000
    machine.receive(DeltaDiscoveryRequest(type_url=T.ENDPOINT,
                                          resource_names_unsubscribe=["a" * 1000],
                                          resource_names_subscribe=["c" * 1000]))
    assert machine.held_bytes == 6000  # a out, c in
    with pytest.raises(ResourceLimitExceeded, match="10001 bytes"):  # another type, same stream
        machine.receive(DeltaDiscoveryRequest(type_url=T.ROUTE, resource_names_subscribe=[
            "d" * 1000, "e" * 1000, "f" * 1000, "g" * 1001]))
    with pytest.raises(ResourceLimitExceeded, match="at most 10000 per stream"):
        DeltaStream(limits=StreamLimits(max_subscription_bytes=10_000)).receive(
            DeltaDiscoveryRequest(type_url=T.ENDPOINT, initial_resource_versions={
                f"{i}" * 1000: "v" * 1000 for i in range(6)}))


def test_a_sotw_stream_is_held_to_the_same_budget_as_its_subscriptions_change():
    machine = SotwStream(limits=StreamLimits(max_subscription_bytes=5000))
    machine.receive(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a" * 1000] * 3))
    machine.receive(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["b" * 1000] * 4))
    assert machine.held_bytes == 1000  # a subscription replaces the last one: duplicates once
    machine.receive(DiscoveryRequest(type_url=T.ROUTE, resource_names=[
        f"{i}" * 1000 for i in range(4)]))
    with pytest.raises(ResourceLimitExceeded, match="6000 bytes"):
        machine.receive(DiscoveryRequest(type_url=T.ENDPOINT,
                                         resource_names=["b" * 1000, "c" * 1000]))


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_an_ads_stream_may_request_at_most_max_types_type_urls(api):
    machine = _machine(api, StreamLimits(max_types=3))
    for kind in ("one", "two", "three", "three"):
        machine.receive(_request(api, type_url=f"type.googleapis.com/made.up.{kind}"))
    with pytest.raises(ResourceLimitExceeded, match=r"at most 3 per stream .*max_types"):
        machine.receive(_request(api, type_url="type.googleapis.com/made.up.four"))


# ---- what is logged or kept ------------------------------------------------------------------

def _info(node_id: str, api: str = "sotw", peer: str = "ipv4:127.0.0.1:5000") -> StreamInfo:
    machine = SotwStream()
    machine.node = base_pb2.Node(id=node_id)  # as kept, whatever a machine accepted
    return StreamInfo(peer, api, "AggregatedDiscoveryService", machine)


class _Failing(StreamObserver):
    def on_open(self, stream: StreamInfo) -> None:
        raise RuntimeError("boom")


def test_log_lines_show_peer_strings_escaped_and_cut(caplog):
    node_id = HOSTILE + "n" * 5000
    stream = _info(node_id)
    response = SotwStream()
    response.receive(DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a"]))
    [sent] = response.responses(snapshot(BASE))
    with caplog.at_level(logging.DEBUG, logger="trimtab.xds"):
        StreamLog().on_event(stream, Nack(T.ENDPOINT, "4", "v1", HOSTILE * 10_000, {"a": "v2"}))
        StreamLog().on_error(stream, ProtocolError("no type_url"))
        PushLog().on_sent(stream, Sent(sent, 100, 0.001))
        Observers([_Failing()]).on_open(stream)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4
    for line in lines:
        assert not any(ord(char) < 0x20 or char in "\x7f\u2028\u202e" for char in line), line
        assert "FAKE LOG LINE" in line and len(line) < 10 * (2000 + 256) + 500  # \U0010ffff
        assert "\\n\\r\\x1b[31mFAKE LOG LINE\\u2028\\u202e\\x00" in line  # escaped, readable
    assert f"({len(node_id) - 256} more characters)" in lines[0]  # the node id: 256 shown


def test_a_protocol_error_about_an_unknown_type_url_shows_it_escaped_and_cut():
    machine = SotwStream(limits=StreamLimits(max_resource_names=1))
    with pytest.raises(ProtocolError) as refused:
        machine.receive(DiscoveryRequest(type_url="made.up\n" + "t" * 200,
                                         resource_names=["a", "b", "c"]))
    assert "\n" not in str(refused.value) and "'made.up\\n" in str(refused.value)
    per_type = SotwStream(default_type_url=T.CLUSTER)
    with pytest.raises(ProtocolError, match=r"more characters\) sent on the cds service"):
        per_type.receive(DiscoveryRequest(type_url="x\n" * 120))


def test_25_hostile_streams_keep_the_nack_log_under_1_mib():
    """The review's attack: 25 streams with huge node ids and NACK details. Huge ids are
    refused at the edge; ids at the bound and huge details leave /v1/nacks (its JSON as the
    admin API writes it) under 1 MiB; today's code answered 210 MB."""
    nacks = NackLog()
    for i in range(25):
        huge = SotwStream()
        with pytest.raises(ProtocolError):
            huge.receive(DiscoveryRequest(node={"id": "x" * MB}, type_url=T.ENDPOINT,
                                          resource_names=["a"]))
        machine = SotwStream()
        machine.receive(DiscoveryRequest(node={"id": f"{i:02d}" + "\x01" * 1022},
                                         type_url=T.ENDPOINT, resource_names=["a", "b"]))
        [response] = machine.responses(snapshot(BASE))
        reply = DiscoveryRequest(type_url=T.ENDPOINT, resource_names=["a", "b"],
                                 response_nonce=response.nonce)
        reply.error_detail.message = "\U0001f600\x01" * MB  # 5 MB of JSON-expensive text
        info = StreamInfo(f"ipv4:10.0.0.{i}:5000", "sotw", "AggregatedDiscoveryService", machine)
        for event in machine.receive(reply):
            nacks.on_event(info, event)
    document = json.dumps({"total": nacks.total, "recent": nacks.recent()}, indent=1,
                          sort_keys=True)
    assert nacks.total == 25 and len(document.encode()) < MB


def test_the_nack_log_is_bounded_whatever_a_record_holds():
    """A full log (100 records) of records at every bound, in the characters JSON escapes
    longest, stays under 4 MiB; names beyond the 16th rejected are counted, not kept."""
    nacks = NackLog()
    rejected = {f"cluster-{i:05d}": "0123456789abcdef" for i in range(10_000)}
    for i in range(150):
        info = _info("\x01" * 8 * MB, peer=f"ipv4:10.0.0.{i % 250}:5000")
        nacks.on_event(info, Nack(T.ENDPOINT, "7", "v", "\x02" * 8 * MB, rejected))
    recent = nacks.recent()
    document = json.dumps({"total": nacks.total, "recent": recent}, indent=1, sort_keys=True)
    assert (len(recent), nacks.total) == (100, 150)
    assert len(document.encode()) < 4 * MB
    record = recent[0]
    assert len(record["node"].encode()) <= 1024 and len(record["detail"].encode()) <= 4096
    assert len(record["rejected"]) == 16 and record["rejected_count"] == 10_000


def test_a_made_up_type_url_is_counted_as_other_not_as_a_new_metrics_series():
    made_up = "type.googleapis.com/made.up.Type" + "x" * 100
    stream, metrics = _info("n-1", api="labels"), StreamMetrics()
    metrics.on_open(stream)
    for type_url in (made_up, T.ENDPOINT):
        stream.types.add(type_url)
        metrics.on_subscribe(stream, type_url)
    assert sample_value("trimtab_xds_subscriptions", type="other", api="labels") == 1
    assert sample_value("trimtab_xds_subscriptions", type="eds", api="labels") == 1
    assert sample_value("trimtab_xds_subscriptions", type="Type" + "x" * 100, api="labels") == 0
    metrics.on_close(stream)
    assert sample_value("trimtab_xds_subscriptions", type="other", api="labels") == 0
