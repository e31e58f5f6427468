"""The sans-IO xDS stream machines: no gRPC, no Envoy, just requests in and responses out."""

from __future__ import annotations

import pytest
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DiscoveryRequest
from google.rpc import status_pb2

from tests.xds_fixtures import BASE, snapshot
from xds_server import type_urls as T
from xds_server.cache import MAX_REJECTION_NODES, SnapshotCache
from xds_server.protocol import (
    Ack,
    DeltaStream,
    Nack,
    ProtocolError,
    Rejections,
    SotwStream,
    StaleNonce,
)


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


def test_rejections_survive_a_reconnect_of_the_same_node():
    memory = Rejections()
    s1 = SotwStream(rejections=memory)
    s1.receive(sotw(T.CLUSTER))
    [resp] = s1.responses(snapshot(BASE))
    s1.receive(sotw(T.CLUSTER, nonce=resp.nonce, error="no"))
    s2 = SotwStream(rejections=memory)
    s2.receive(sotw(T.CLUSTER))
    assert s2.responses(snapshot(BASE)) == []


def test_nack_memory_is_kept_for_a_bounded_number_of_node_ids():
    assert SnapshotCache().max_rejection_nodes == MAX_REJECTION_NODES
    cache = SnapshotCache(max_rejection_nodes=3)
    cache.rejections_for("n0").record(T.CLUSTER, {}, "v-bad")
    held = cache.rejections_for("n1")  # a stream of n1 is still open
    cache.rejections_for("n2")
    assert cache.rejections_for("n0").states == {T.CLUSTER: {"v-bad"}}  # used: most recent
    for i in range(3, 1000):
        cache.rejections_for(f"n{i}")
        assert cache.rejection_nodes <= 3
    assert cache.rejections_for("n1") is held  # a stream's memory is shared while it is held
    assert cache.rejections_for("n0").states == {}  # forgotten: seen too long ago


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
