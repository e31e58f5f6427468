"""The sans-IO xDS stream machines: no gRPC, no Envoy, just requests in and responses out."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DiscoveryRequest
from google.rpc import status_pb2

from tests.support.xds_fixtures import BASE, snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.protocol import (
    MAX_REJECTED_VERSIONS,
    MAX_RESOURCE_NAMES,
    RESPONSE_HEADROOM,
    Ack,
    DeltaStream,
    Nack,
    ProtocolError,
    Rejections,
    ResourceLimitExceeded,
    SotwStream,
    StaleNonce,
    StreamLimits,
    Withheld,
)
from xds_server.xds.server import encode_delta, encode_sotw


def sotw(type_url: str, names=(), nonce: str = "", version: str = "", error: str | None = None,
         node: str | None = None) -> DiscoveryRequest:
    req = DiscoveryRequest(type_url=type_url, resource_names=list(names), response_nonce=nonce,
                           version_info=version)
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    if node is not None:
        req.node.id = node
    return req


def delta(type_url: str, sub=(), unsub=(), nonce: str = "", error: str | None = None,
          initial: dict[str, str] | None = None, node: str | None = None) -> DeltaDiscoveryRequest:
    req = DeltaDiscoveryRequest(type_url=type_url, resource_names_subscribe=list(sub),
                                resource_names_unsubscribe=list(unsub), response_nonce=nonce)
    for name, version in (initial or {}).items():
        req.initial_resource_versions[name] = version
    if error is not None:
        req.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    if node is not None:
        req.node.id = node
    return req


def changed(weights: dict, cluster: str, address: str, weight: int) -> dict:
    out = {c: dict(eps) for c, eps in weights.items()}
    out[cluster][address] = weight
    return out


# ---- SotW ---------------------------------------------------------------------------------

def test_sotw_initial_wildcard_cds_gets_full_state_and_keeps_node():
    s = SotwStream()
    snap = snapshot(BASE)
    s.receive(sotw(T.CLUSTER, node="envoy-1"))
    [resp] = s.responses(snap)
    assert resp.type_url == T.CLUSTER
    assert [r.name for r in resp.resources] == ["a", "b"]
    assert resp.version == snap.versions[T.CLUSTER]
    # node arrives only on the first message (set_node_on_first_message_only)
    s.receive(sotw(T.CLUSTER, nonce=resp.nonce, version=resp.version))
    assert s.node is not None and s.node.id == "envoy-1"


def test_sotw_ack_then_nothing_until_change():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a", "b"]))
    [resp] = s.responses(snapshot(BASE))
    events = s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=resp.nonce, version=resp.version))
    assert events and isinstance(events[0], Ack)
    assert s.responses(snapshot(BASE)) == []


def test_sotw_one_response_in_flight_and_coalesces_to_latest():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a", "b"]))
    [first] = s.responses(snapshot(BASE))
    w1 = changed(BASE, "a", "10.0.0.1:80", 60)
    w2 = changed(BASE, "a", "10.0.0.1:80", 70)
    assert s.responses(snapshot(w1)) == []  # waiting for the ACK
    s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=first.nonce, version=first.version))
    [second] = s.responses(snapshot(w2))
    assert [r.name for r in second.resources] == ["a"]  # only the changed CLA
    assert second.resources[0].version == snapshot(w2).of_type(T.ENDPOINT)["a"].version


def test_sotw_nack_is_counted_and_never_resent_but_next_version_is():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a", "b"]))
    [first] = s.responses(snapshot(BASE))
    s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=first.nonce, version=first.version))
    bad = changed(BASE, "a", "10.0.0.1:80", 0)
    [push] = s.responses(snapshot(bad))
    events = s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=push.nonce,
                            version=first.version, error="weight must be >= 1"))
    assert isinstance(events[0], Nack) and "weight" in events[0].detail
    assert events[0].rejected == {"a": snapshot(bad).of_type(T.ENDPOINT)["a"].version}
    for _ in range(3):  # the same bad version, again and again: never re-sent
        assert s.responses(snapshot(bad)) == []
    good = changed(BASE, "a", "10.0.0.1:80", 42)
    [fixed] = s.responses(snapshot(good))
    assert [r.name for r in fixed.resources] == ["a"]


def test_sotw_nack_of_full_state_type_blocks_that_state_only():
    s = SotwStream()
    s.receive(sotw(T.CLUSTER))
    [resp] = s.responses(snapshot(BASE))
    s.receive(sotw(T.CLUSTER, nonce=resp.nonce, error="bad cluster"))
    assert s.responses(snapshot(BASE)) == []
    assert s.responses(snapshot({**BASE, "c": {"10.0.2.1:80": 1}}))


def test_sotw_stale_nonce_is_ignored():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a"]))
    [resp] = s.responses(snapshot(BASE))
    events = s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce="not-" + resp.nonce))
    assert events == [StaleNonce(T.ENDPOINT, "not-" + resp.nonce)]
    assert s.types[T.ENDPOINT].names == {"a"}
    assert s.types[T.ENDPOINT].pending_nonce == resp.nonce  # still waiting for the real reply


def test_sotw_subscription_change_sends_new_names_only():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a"]))
    [resp] = s.responses(snapshot(BASE))
    assert [r.name for r in resp.resources] == ["a"]
    s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=resp.nonce, version=resp.version))
    [more] = s.responses(snapshot(BASE))
    assert [r.name for r in more.resources] == ["b"]


def test_sotw_resubscribe_after_unsubscribe_gets_a_resend():
    s = SotwStream()
    s.receive(sotw(T.ENDPOINT, names=["a", "b"]))
    [r1] = s.responses(snapshot(BASE))
    s.receive(sotw(T.ENDPOINT, names=["a"], nonce=r1.nonce, version=r1.version))
    assert s.responses(snapshot(BASE)) == []
    s.receive(sotw(T.ENDPOINT, names=["a", "b"], nonce=r1.nonce, version=r1.version))
    [r2] = s.responses(snapshot(BASE))
    assert [r.name for r in r2.resources] == ["b"]


def test_sotw_empty_nonce_request_forces_a_resend():
    s = SotwStream()
    s.receive(sotw(T.CLUSTER))
    [r1] = s.responses(snapshot(BASE))
    s.receive(sotw(T.CLUSTER, nonce=r1.nonce, version=r1.version))
    s.receive(sotw(T.CLUSTER))  # re-request from scratch, no version held
    [r2] = s.responses(snapshot(BASE))
    assert r2.version == r1.version and r2.nonce != r1.nonce


def test_sotw_reconnect_with_current_version_gets_nothing():
    snap = snapshot(BASE)
    s = SotwStream()
    s.receive(sotw(T.CLUSTER, version=snap.versions[T.CLUSTER], node="n"))
    s.receive(sotw(T.ENDPOINT, names=["a", "b"], version=snap.versions[T.ENDPOINT]))
    assert s.responses(snap) == []
    # ... but a later change still flows
    [resp] = s.responses(snapshot(changed(BASE, "b", "10.0.1.1:80", 11)))
    assert [r.name for r in resp.resources] == ["b"]


def test_sotw_ads_order_cds_before_eds_lds_before_rds():
    s = SotwStream()
    for type_url, names in ((T.ROUTE, ["routes"]), (T.LISTENER, []), (T.ENDPOINT, ["a"]),
                            (T.CLUSTER, [])):
        s.receive(sotw(type_url, names=names))
    order = [r.type_url for r in s.responses(snapshot(BASE))]
    assert order == [T.CLUSTER, T.ENDPOINT, T.LISTENER, T.ROUTE]


def test_protocol_errors_are_the_peers():
    with pytest.raises(ProtocolError):
        SotwStream().receive(sotw(""))
    with pytest.raises(ProtocolError):
        SotwStream(default_type_url=T.CLUSTER).receive(sotw(T.ENDPOINT, names=["a"]))
    per_type = SotwStream(default_type_url=T.CLUSTER)
    per_type.receive(sotw(""))  # per-type services may leave type_url empty
    assert per_type.responses(snapshot(BASE))[0].type_url == T.CLUSTER


def test_a_nacked_state_is_never_resent_on_that_stream_even_after_a_resubscription():
    s = SotwStream()
    s.receive(sotw(T.CLUSTER))
    [resp] = s.responses(snapshot(BASE))
    s.receive(sotw(T.CLUSTER, nonce=resp.nonce, error="no"))
    s.receive(sotw(T.CLUSTER))  # a request without nonce would otherwise force an answer
    assert s.responses(snapshot(BASE)) == []
    [nxt] = s.responses(snapshot({**BASE, "c": {"10.0.2.1:80": 1}}))  # a different state is sent
    assert [r.name for r in nxt.resources] == ["a", "b", "c"]


def test_nack_memory_belongs_to_the_stream_so_a_new_stream_gets_the_current_state():
    snap = snapshot(BASE)
    first = SotwStream()
    first.receive(sotw(T.CLUSTER, node="victim"))
    [resp] = first.responses(snap)
    first.receive(sotw(T.CLUSTER, nonce=resp.nonce, error="no"))
    again = SotwStream()  # the same node id on a new stream has rejected nothing yet
    again.receive(sotw(T.CLUSTER, node="victim"))
    [resp2] = again.responses(snap)
    assert resp2.version == resp.version and [r.name for r in resp2.resources] == ["a", "b"]


def test_rejection_memory_is_bounded_per_resource():
    memory = Rejections()
    for i in range(3 * MAX_REJECTED_VERSIONS):
        memory.record(T.ENDPOINT, {"a": f"v{i}"}, f"s{i}")
    kept = memory.of_type(T.ENDPOINT)["a"]
    assert len(kept) == MAX_REJECTED_VERSIONS and kept[-1] == f"v{3 * MAX_REJECTED_VERSIONS - 1}"
    assert memory.resource_rejected(T.ENDPOINT, "a", kept[0])
    assert not memory.resource_rejected(T.ENDPOINT, "a", "v0")  # the oldest was forgotten
    assert len(memory.states[T.ENDPOINT]) == MAX_REJECTED_VERSIONS


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_node_claimed_after_the_first_request_is_ignored(api):
    machine, request = (SotwStream(), sotw) if api == "sotw" else (DeltaStream(), delta)
    machine.receive(request(T.CLUSTER, node="edge-1"))
    machine.receive(request(T.ENDPOINT, node="victim"))
    assert machine.node is not None and machine.node.id == "edge-1"
    anonymous = SotwStream() if api == "sotw" else DeltaStream()
    anonymous.receive(request(T.CLUSTER))  # authorised as no node at all
    anonymous.receive(request(T.ENDPOINT, node="victim"))
    assert anonymous.node is None


# ---- Limits: names per subscription ---------------------------------------------------------

def test_sotw_subscription_above_max_resource_names_is_the_peers_fault():
    s = SotwStream(limits=StreamLimits(max_resource_names=3))
    s.receive(sotw(T.ENDPOINT, names=["a", "b", "c", "*"]))  # the wildcard is not a name
    with pytest.raises(ResourceLimitExceeded, match=r"4 eds resource names.*at most 3.*"
                                                    r"max_resource_names"):
        s.receive(sotw(T.ENDPOINT, names=["a", "b", "c", "d"]))
    assert issubclass(ResourceLimitExceeded, ProtocolError)
    assert StreamLimits().max_resource_names == MAX_RESOURCE_NAMES


def test_delta_subscriptions_count_towards_max_resource_names_cumulatively():
    d = DeltaStream(limits=StreamLimits(max_resource_names=3))
    d.receive(delta(T.ENDPOINT, sub=["a", "b"]))
    d.receive(delta(T.ENDPOINT, sub=["c"], unsub=["a"]))
    d.receive(delta(T.ENDPOINT, sub=["a"], unsub=["b"]))  # a, c: never more than 3
    with pytest.raises(ResourceLimitExceeded):
        d.receive(delta(T.ENDPOINT, sub=["x", "y"]))  # 4 names held
    with pytest.raises(ResourceLimitExceeded, match="initial_resource_versions"):
        DeltaStream(limits=StreamLimits(max_resource_names=3)).receive(
            delta(T.CLUSTER, initial={n: "v" for n in "abcd"}))


# ---- Limits: response size, parts ------------------------------------------------------------

def _many(count: int, endpoints: int = 8) -> dict:
    return {f"c{i:02d}": {f"10.0.{i}.{e}:80": 1 + e for e in range(endpoints)} for i in range(count)}


def _limits_for(snap, per_part: int, api: str = "delta") -> StreamLimits:
    """Room for `per_part` of the snapshot's (about equal-sized) CLAs per response."""
    size = max(len(r.delta_field if api == "delta" else r.sotw_field)
               for r in snap.of_type(T.ENDPOINT).values())
    return StreamLimits(max_response_bytes=RESPONSE_HEADROOM + per_part * size + size // 2)


def _drain(machine, request, snap, type_url=T.ENDPOINT, nack=frozenset(), **subscribe):
    """Answer every response until nothing more is sent; returns them. NACKs the parts
    carrying a name in `nack`."""
    out = []
    while True:
        got = machine.responses(snap)
        if not got:
            return out
        for resp in got:
            out.append(resp)
            bad = nack & {r.name for r in resp.resources}
            kwargs = dict(subscribe) if request is sotw else {}
            if request is sotw:
                kwargs["version"] = resp.version
            machine.receive(request(resp.type_url, nonce=resp.nonce,
                                    error="bad" if bad else None, **kwargs))


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_push_larger_than_max_response_bytes_is_split_into_parts_sent_one_at_a_time(api):
    snap = snapshot(_many(10))
    limits = _limits_for(snap, 3, api)
    machine = SotwStream(limits=limits) if api == "sotw" else DeltaStream(limits=limits)
    request = sotw if api == "sotw" else delta
    subscribe = {"names": sorted(snap.of_type(T.ENDPOINT))} if api == "sotw" else {}
    machine.receive(request(T.ENDPOINT, **(subscribe or {"sub": sorted(snap.of_type(T.ENDPOINT))})))
    [first] = machine.responses(snap)
    assert machine.responses(snap) == []  # one part in flight at a time
    machine.receive(request(T.ENDPOINT, nonce=first.nonce, version=first.version, **subscribe)
                    if api == "sotw" else request(T.ENDPOINT, nonce=first.nonce))
    parts = [first, *_drain(machine, request, snap, **subscribe)]
    encode = encode_sotw if api == "sotw" else encode_delta
    assert len(parts) == 4 and all(len(encode(p)) <= limits.part_bytes + 300 for p in parts)
    assert all(len(encode(p)) + 5 <= limits.max_response_bytes for p in parts)
    names = [r.name for p in parts for r in p.resources]
    assert sorted(names) == sorted(snap.of_type(T.ENDPOINT)) and len(set(names)) == 10
    full = snap.versions[T.ENDPOINT]  # every CLA is subscribed: SotW's version is the type's
    assert [p.version for p in parts] == [f"{full}+7", f"{full}+4", f"{full}+1", full]
    assert machine.types[T.ENDPOINT].acked_version == parts[-1].version
    assert _drain(machine, request, snap, **subscribe) == []


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_nacked_part_is_not_resent_and_the_other_parts_still_arrive(api):
    snap = snapshot(_many(10))
    limits = _limits_for(snap, 3, api)
    machine = SotwStream(limits=limits) if api == "sotw" else DeltaStream(limits=limits)
    request = sotw if api == "sotw" else delta
    names = sorted(snap.of_type(T.ENDPOINT))
    subscribe = {"names": names} if api == "sotw" else {}
    machine.receive(request(T.ENDPOINT, **(subscribe or {"sub": names})))
    parts = _drain(machine, request, snap, nack=frozenset({"c04"}), **subscribe)
    got = [r.name for p in parts for r in p.resources]
    assert sorted(got) == names and len(got) == 10  # the NACKed part's CLAs were not resent
    nacked = next(p for p in parts if "c04" in {r.name for r in p.resources})
    assert all(machine.rejections.resource_rejected(T.ENDPOINT, r.name, r.version)
               for r in nacked.resources)


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_snapshot_published_between_parts_is_what_the_rest_of_the_push_carries(api):
    before, after = _published(_many(10), changed(_many(10), "c09", "10.0.9.0:80", 77))
    limits = _limits_for(before, 5, api)
    machine = SotwStream(limits=limits) if api == "sotw" else DeltaStream(limits=limits)
    request = sotw if api == "sotw" else delta
    names = sorted(before.of_type(T.ENDPOINT))
    subscribe = {"names": names} if api == "sotw" else {}
    machine.receive(request(T.ENDPOINT, **(subscribe or {"sub": names})))
    [first] = machine.responses(before)
    assert first.version.endswith("+5")
    machine.receive(request(T.ENDPOINT, nonce=first.nonce, version=first.version, **subscribe)
                    if api == "sotw" else request(T.ENDPOINT, nonce=first.nonce))
    rest = _drain(machine, request, after, **subscribe)
    held = {r.name: r.version for p in [first, *rest] for r in p.resources}
    assert held == {n: r.version for n, r in after.of_type(T.ENDPOINT).items()}
    assert rest[-1].version == (after.versions[T.ENDPOINT] if api == "delta"
                                else after.subset(T.ENDPOINT, frozenset(names))[1])


def test_a_sotw_reconnect_holding_only_some_parts_gets_everything_again():
    snap = snapshot(_many(10))
    limits = _limits_for(snap, 5, "sotw")
    names = sorted(snap.of_type(T.ENDPOINT))
    s = SotwStream(limits=limits)
    s.receive(sotw(T.ENDPOINT, names=names))
    [first] = s.responses(snap)
    s.receive(sotw(T.ENDPOINT, names=names, nonce=first.nonce, version=first.version))
    again = SotwStream(limits=limits)  # the stream broke after part 1 was ACKed
    again.receive(sotw(T.ENDPOINT, names=names, version=first.version))
    parts = _drain(again, sotw, snap, names=names)
    assert sorted(r.name for p in parts for r in p.resources) == names


def test_a_resource_that_alone_exceeds_the_limit_is_withheld_and_the_rest_is_sent():
    weights = {**_many(3), "huge": {f"10.9.{e >> 8}.{e & 255}:80": 1 for e in range(200)}}
    snap = snapshot(weights)
    limits = _limits_for(snapshot(_many(3)), 3)
    d = DeltaStream(limits=limits)
    d.receive(delta(T.ENDPOINT, sub=sorted(weights)))
    parts = _drain(d, delta, snap)
    assert sorted(r.name for p in parts for r in p.resources) == ["c00", "c01", "c02"]
    [notice] = d.take_notices()
    huge = snap.of_type(T.ENDPOINT)["huge"]
    assert notice == Withheld(T.ENDPOINT, huge.version, ("huge",), len(huge.delta_field),
                              limits.part_bytes)
    assert _drain(d, delta, snap) == [] and d.take_notices() == []  # once per version


def test_a_whole_state_type_over_the_limit_is_withheld_never_split():
    snap = snapshot(_many(10))
    size = sum(len(r.sotw_field) for r in snap.of_type(T.CLUSTER).values())
    s = SotwStream(limits=StreamLimits(max_response_bytes=RESPONSE_HEADROOM + size - 1))
    s.receive(sotw(T.CLUSTER))
    assert s.responses(snap) == []
    [notice] = s.take_notices()
    assert (notice.type_url, notice.version, len(notice.names), notice.size) == (
        T.CLUSTER, snap.versions[T.CLUSTER], 10, size)
    fits = snapshot(_many(9))
    [resp] = s.responses(fits)  # the next state that fits is sent, whole
    assert len(resp.resources) == 9 and resp.version == fits.versions[T.CLUSTER]


# ---- Delta --------------------------------------------------------------------------------

def test_delta_legacy_wildcard_and_removal():
    d = DeltaStream()
    d.receive(delta(T.CLUSTER))
    [r1] = d.responses(snapshot(BASE))
    assert [r.name for r in r1.resources] == ["a", "b"] and r1.removed == ()
    d.receive(delta(T.CLUSTER, nonce=r1.nonce))
    [r2] = d.responses(snapshot({"a": BASE["a"]}))
    assert r2.resources == () and r2.removed == ("b",)


def test_delta_ack_records_the_version_the_acked_response_carried():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["a", "b"]))
    [r1] = d.responses(snapshot(BASE))
    assert r1.version  # the snapshot's EDS version, as system_version_info
    [ack] = d.receive(delta(T.ENDPOINT, nonce=r1.nonce))  # a Delta ACK carries no version
    assert ack == Ack(T.ENDPOINT, r1.nonce, r1.version)
    assert d.types[T.ENDPOINT].acked_version == r1.version
    bad = changed(BASE, "a", "10.0.0.1:80", 0)
    [r2] = d.responses(snapshot(bad))
    assert r2.version != r1.version
    d.receive(delta(T.ENDPOINT, nonce=r2.nonce, error="weight 0"))
    assert d.types[T.ENDPOINT].acked_version == r1.version  # a NACK keeps what the client holds
    good = changed(BASE, "b", "10.0.1.1:80", 5)
    [r3] = d.responses(snapshot(good))
    d.receive(delta(T.ENDPOINT, nonce=r3.nonce))
    assert d.types[T.ENDPOINT].acked_version == r3.version != r1.version


def test_delta_keeps_the_node_of_the_first_request():
    d = DeltaStream()
    d.receive(delta(T.CLUSTER, node="envoy-1"))
    [resp] = d.responses(snapshot(BASE))
    # set_node_on_first_message_only: later requests carry no node
    d.receive(delta(T.CLUSTER, nonce=resp.nonce))
    d.receive(delta(T.ENDPOINT, sub=["a"]))
    assert d.node is not None and d.node.id == "envoy-1"


def test_delta_sends_only_changed_resources():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["a", "b"]))
    [r1] = d.responses(snapshot(BASE))
    events = d.receive(delta(T.ENDPOINT, nonce=r1.nonce))
    assert isinstance(events[0], Ack)
    [r2] = d.responses(snapshot(changed(BASE, "b", "10.0.1.1:80", 99)))
    assert [r.name for r in r2.resources] == ["b"]


def test_delta_reconnect_with_initial_versions_skips_unchanged():
    snap = snapshot(BASE)
    held = {name: res.version for name, res in snap.of_type(T.CLUSTER).items()}
    d = DeltaStream()
    d.receive(delta(T.CLUSTER, initial=held))
    assert d.responses(snap) == []
    stale = dict(held, a="old-version", gone="v1")
    d2 = DeltaStream()
    d2.receive(delta(T.CLUSTER, initial=stale))
    [resp] = d2.responses(snap)
    assert [r.name for r in resp.resources] == ["a"] and resp.removed == ("gone",)


def test_delta_nack_not_resent_and_other_resources_keep_updating():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["a", "b"]))
    [r1] = d.responses(snapshot(BASE))
    d.receive(delta(T.ENDPOINT, nonce=r1.nonce))
    bad = changed(BASE, "a", "10.0.0.1:80", 0)
    [r2] = d.responses(snapshot(bad))
    events = d.receive(delta(T.ENDPOINT, nonce=r2.nonce, error="weight 0"))
    assert isinstance(events[0], Nack)
    assert d.responses(snapshot(bad)) == []
    both = changed(bad, "b", "10.0.1.1:80", 77)
    [r3] = d.responses(snapshot(both))
    assert [r.name for r in r3.resources] == ["b"]  # the bad "a" stays unsent


def test_delta_stale_nonce_still_applies_subscription_diff():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["a"]))
    [r1] = d.responses(snapshot(BASE))
    events = d.receive(delta(T.ENDPOINT, sub=["b"], nonce="999"))
    assert StaleNonce(T.ENDPOINT, "999") in events
    assert d.types[T.ENDPOINT].names == {"a", "b"}
    d.receive(delta(T.ENDPOINT, nonce=r1.nonce))
    [r2] = d.responses(snapshot(BASE))
    assert [r.name for r in r2.resources] == ["b"]


def test_delta_unsubscribe_then_resubscribe_resends():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["a", "b"]))
    [r1] = d.responses(snapshot(BASE))
    d.receive(delta(T.ENDPOINT, unsub=["b"], nonce=r1.nonce))
    assert d.responses(snapshot(BASE)) == []
    d.receive(delta(T.ENDPOINT, sub=["b"]))
    [r2] = d.responses(snapshot(BASE))
    assert [r.name for r in r2.resources] == ["b"]


def test_delta_explicit_wildcard_subscription():
    d = DeltaStream()
    d.receive(delta(T.ENDPOINT, sub=["*"]))
    [resp] = d.responses(snapshot(BASE))
    assert {r.name for r in resp.resources} == {"a", "b"}


# ---- Cost: unchanged types are skipped, changed names only are looked at ---------------------

def _published(*weights: dict) -> list:
    """Snapshots as the cache publishes them: each records what changed since the previous."""
    out: list = []
    for w in weights:
        out.append(snapshot(w).reusing(out[-1] if out else None))
    return out


def _evaluated_types(machine, snap) -> tuple[list[str], list]:
    """Which types `responses(snap)` evaluates, and its responses."""
    seen: list[str] = []
    respond = machine._respond

    def spy(st, snapshot_):
        seen.append(st.type_url)
        return respond(st, snapshot_)

    machine._respond = spy
    try:
        return seen, machine.responses(snap)
    finally:
        del machine._respond


def _stream(api: str):
    """A machine, its request builder, and the EDS subscription to a, b, c in its dialect."""
    if api == "sotw":
        return SotwStream(), sotw, {"names": ["a", "b", "c"]}, {"names": ["a", "b", "c"]}
    return DeltaStream(), delta, {"sub": ["a", "b", "c"]}, {}


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_a_snapshot_changing_only_eds_evaluates_only_eds_and_acks_cost_nothing(api):
    s0, s1 = _published(BASE, changed(BASE, "a", "10.0.0.1:80", 7))
    machine, request, subscribe, ack = _stream(api)
    machine.receive(request(T.CLUSTER))
    machine.receive(request(T.ENDPOINT, **subscribe))
    for resp in machine.responses(s0):
        machine.receive(request(resp.type_url, nonce=resp.nonce,
                                **(ack if resp.type_url == T.ENDPOINT else {})))
    assert _evaluated_types(machine, s0) == ([], [])
    assert machine.types[T.ENDPOINT].changed_names(s1) == {"a"}  # the only name looked at
    seen, [resp] = _evaluated_types(machine, s1)
    assert seen == [T.ENDPOINT] and [r.name for r in resp.resources] == ["a"]
    machine.receive(request(T.ENDPOINT, nonce=resp.nonce, **ack))
    assert _evaluated_types(machine, s1) == ([], [])


@pytest.mark.parametrize("api", ["sotw", "delta"])
def test_snapshots_published_while_a_response_is_in_flight_all_reach_the_client(api):
    three = {**BASE, "c": {"10.0.2.1:80": 1}}
    one = changed(three, "a", "10.0.0.1:80", 7)
    two = {k: v for k, v in changed(one, "b", "10.0.1.1:80", 8).items() if k != "c"}
    s0, s1, s2 = _published(three, one, two)
    machine, request, subscribe, ack = _stream(api)
    machine.receive(request(T.ENDPOINT, **subscribe))
    [first] = machine.responses(s0)
    assert machine.responses(s1) == [] and machine.responses(s2) == []  # in flight: they wait
    machine.receive(request(T.ENDPOINT, nonce=first.nonce, **ack))
    [second] = machine.responses(s2)  # s2 changed b and c since s1; s1 had changed a
    assert {r.name: r.version for r in second.resources} == {
        name: s2.of_type(T.ENDPOINT)[name].version for name in ("a", "b")}
    assert second.removed == (("c",) if api == "delta" else ())


def test_a_request_far_over_max_resource_names_is_refused_on_its_raw_count():
    s = SotwStream(limits=StreamLimits(max_resource_names=3))
    with pytest.raises(ResourceLimitExceeded, match="subscribes to 6 eds"):
        s.receive(sotw(T.ENDPOINT, names=["a", "a", "a", "a", "b", "*"]))  # 5 + "*": too many
    s.receive(sotw(T.ENDPOINT, names=["a", "a", "b", "*"]))  # 3 + "*", 2 distinct: accepted
    assert s.types[T.ENDPOINT].names == {"a", "b"} and s.types[T.ENDPOINT].wildcard
