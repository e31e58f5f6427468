"""Snapshots: deterministic content hashes, per-cluster EDS versions, consistency, shared bytes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from envoy.config.endpoint.v3.endpoint_pb2 import ClusterLoadAssignment
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryResponse, DiscoveryResponse

from tests.support.xds_fixtures import BASE, cla, cluster, listener, routes, snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.protocol import Response
from xds_server.xds.server import encode_delta, encode_sotw
from xds_server.xds.snapshot import (
    EMPTY_TYPE_VERSION,
    MAX_SUBSET_BYTES,
    InconsistentSnapshotError,
    SubsetMemo,
    TypeChange,
    build_snapshot,
    subset_entry_bytes,
    type_version,
)


def test_same_inputs_same_versions_and_order_does_not_matter():
    a = snapshot(BASE)
    b = snapshot(dict(reversed(list(BASE.items()))))
    assert a.version == b.version
    assert dict(a.versions) == dict(b.versions)


def test_versions_are_stable_across_processes():
    code = ("from tests.support.xds_fixtures import BASE, snapshot; s = snapshot(BASE); "
            "print(s.version, *sorted(r.version for r in s.of_type("
            "'type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment').values()))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    here = snapshot(BASE)
    expected = " ".join([here.version, *sorted(r.version for r in here.of_type(T.ENDPOINT).values())])
    assert runs == {expected + "\n"}


def test_eds_is_versioned_per_cluster():
    before = snapshot(BASE)
    after = snapshot({**BASE, "a": {"10.0.0.1:80": 51, "10.0.0.2:80": 50}})
    eds_before, eds_after = before.of_type(T.ENDPOINT), after.of_type(T.ENDPOINT)
    assert eds_before["a"].version != eds_after["a"].version
    assert eds_before["b"].version == eds_after["b"].version
    assert before.versions[T.CLUSTER] == after.versions[T.CLUSTER]


def test_dangling_eds_reference_is_refused():
    with pytest.raises(InconsistentSnapshotError, match="'ghost'"):
        build_snapshot({T.CLUSTER: [cluster("a"), cluster("ghost")],
                        T.ENDPOINT: [cla("a", {"10.0.0.1:80": 1})]})


def test_dangling_rds_and_route_cluster_references_are_refused():
    with pytest.raises(InconsistentSnapshotError, match="RDS 'missing'"):
        build_snapshot({T.LISTENER: [listener("missing")], T.ROUTE: [routes([], "routes")]})
    with pytest.raises(InconsistentSnapshotError, match="cluster 'nope'"):
        build_snapshot({T.LISTENER: [listener()], T.ROUTE: [routes(["nope"])]})


def test_duplicate_names_are_refused():
    with pytest.raises(InconsistentSnapshotError, match="duplicated"):
        build_snapshot({T.ENDPOINT: [cla("a", {}), cla("a", {})]})


def test_cache_keeps_last_good_and_is_level_based():
    cache = SnapshotCache()
    woken = []
    cache.watch(lambda: woken.append(1))
    first = snapshot(BASE)
    assert cache.set_snapshot(first)
    assert not cache.set_snapshot(snapshot(BASE))  # same content: no wake-up
    assert woken == [1]
    with pytest.raises(InconsistentSnapshotError):
        cache.set_snapshot(build_snapshot({T.CLUSTER: [cluster("x")]}))
    assert cache.snapshot is not None and cache.snapshot.version == first.version


def test_cache_reuses_unchanged_resource_objects_so_bytes_are_shared():
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(BASE))
    old_b = cache.snapshot.of_type(T.ENDPOINT)["b"]
    encoded = old_b.sotw_field
    cache.set_snapshot(snapshot({**BASE, "a": {"10.0.0.1:80": 1}}))
    assert cache.snapshot.of_type(T.ENDPOINT)["b"] is old_b
    assert cache.snapshot.of_type(T.ENDPOINT)["b"].sotw_field is encoded


def test_hand_encoded_responses_parse_as_the_real_messages():
    snap = snapshot(BASE)
    resources = tuple(snap.of_type(T.ENDPOINT).values())
    resp = Response(T.ENDPOINT, "v1", "7", resources, removed=("gone",))
    sotw = DiscoveryResponse.FromString(encode_sotw(resp))
    assert (sotw.version_info, sotw.nonce, sotw.type_url) == ("v1", "7", T.ENDPOINT)
    unpacked = [ClusterLoadAssignment.FromString(a.value) for a in sotw.resources]
    assert [u.cluster_name for u in unpacked] == ["a", "b"]
    assert unpacked[0] == resources[0].message
    delta = DeltaDiscoveryResponse.FromString(encode_delta(resp))
    assert [(r.name, r.version) for r in delta.resources] == [(r.name, r.version) for r in resources]
    assert list(delta.removed_resources) == ["gone"] and delta.nonce == "7"
    assert delta.system_version_info == "v1"


def test_type_versions_and_subsets_are_precomputed_and_shared():
    snap = snapshot(BASE)
    for type_url in (T.CLUSTER, T.ENDPOINT, T.LISTENER, T.ROUTE):
        assert snap.type_version_of(type_url) == type_version(snap.of_type(type_url))
    assert snap.type_version_of("type.googleapis.com/unknown") == EMPTY_TYPE_VERSION
    wanted, version = snap.subset(T.ENDPOINT, frozenset({"b", "a"}))
    assert list(wanted) == ["a", "b"] and version == type_version(wanted)
    assert snap.subset(T.ENDPOINT, frozenset({"a", "b"}))[0] is wanted  # computed once
    only_b, only_b_version = snap.subset(T.ENDPOINT, frozenset({"b"}))
    assert list(only_b) == ["b"] and only_b_version == type_version(only_b) != version
    assert len(snap.subset_memo) == 2


def test_a_subset_naming_what_the_snapshot_lacks_is_answered_but_never_memoised():
    snap = snapshot(BASE)
    made_up = frozenset({"a", *(f"ghost-{i}" for i in range(10_000))})
    wanted, version = snap.subset(T.ENDPOINT, made_up)
    assert list(wanted) == ["a"] and version == type_version(wanted)
    assert len(snap.subset_memo) == 0 and snap.subset_memo.bytes == 0
    present = made_up & snap.names_of(T.ENDPOINT)
    assert snap.subset(T.ENDPOINT, present) == (wanted, version) and len(snap.subset_memo) == 1


def test_the_subset_memo_counts_bytes_and_stays_within_its_budget():
    snap = snapshot({f"c{i:03d}": {"10.0.0.1:80": 1} for i in range(200)})
    names = sorted(snap.names_of(T.ENDPOINT))
    keys = [frozenset(names[i:i + 50]) for i in range(0, 150, 10)]
    values = [snap.subset(T.ENDPOINT, key) for key in keys]
    memo = snap.subset_memo
    assert memo.bytes == sum(subset_entry_bytes(k, v) for k, v in zip(keys, values, strict=True))
    assert memo.max_bytes == MAX_SUBSET_BYTES and memo.bytes > 15 * 50 * 100  # names, dict slots
    small = SubsetMemo(max_bytes=3 * subset_entry_bytes(keys[0], values[0]))
    for key, value in zip(keys, values, strict=True):
        small.put((T.ENDPOINT, key), value)
        assert small.bytes <= small.max_bytes
    assert len(small) == 3 and small.get((T.ENDPOINT, keys[-1])) is values[-1]
    assert small.get((T.ENDPOINT, keys[0])) is None  # least recently used went first
    tiny = SubsetMemo(max_bytes=100)
    tiny.put((T.ENDPOINT, keys[0]), values[0])  # larger than the whole budget: not kept
    assert len(tiny) == 0 and tiny.bytes == 0


def test_names_of_is_shared_with_the_previous_snapshot_while_the_names_do_not_change():
    cache = SnapshotCache()
    cache.set_snapshot(snapshot(BASE))
    first = cache.snapshot
    cache.set_snapshot(snapshot({**BASE, "a": {"10.0.0.1:80": 3}}))  # new weights, same names
    second = cache.snapshot
    assert first is not None and second is not None and second.version != first.version
    assert second.names_of(T.ENDPOINT) is first.names_of(T.ENDPOINT) == {"a", "b"}
    cache.set_snapshot(snapshot({**BASE, "c": {"10.0.2.1:80": 1}}))
    third = cache.snapshot
    assert third is not None and third.names_of(T.ENDPOINT) == {"a", "b", "c"}


def test_a_published_snapshot_records_what_changed_per_type():
    three = {**BASE, "c": {"10.0.2.1:80": 1}}
    before = snapshot(three)
    after = snapshot({"a": {"10.0.0.1:80": 1}, "b": three["b"], "d": {"10.0.3.1:80": 1}})
    cache = SnapshotCache()
    cache.set_snapshot(before)
    cache.set_snapshot(after)
    published = cache.snapshot
    assert published is not None and published.version == after.version
    assert published.changes[T.ENDPOINT] == TypeChange(before.versions[T.ENDPOINT],
                                                       frozenset({"a", "c", "d"}))
    assert published.changes[T.CLUSTER].names == {"c", "d"}
    assert published.changes[T.LISTENER] == TypeChange(before.versions[T.LISTENER], frozenset())
    assert before.changes == {} and after.changes == {}  # unpublished: nothing known
    gone = build_snapshot({T.CLUSTER: [cluster("x")], T.ENDPOINT: [cla("x", {})]}).reusing(before)
    assert gone.changes[T.ROUTE] == TypeChange(before.versions[T.ROUTE], frozenset({"routes"}))
