"""Frozen, content-hashed, consistency-checked snapshots of xDS resources.

* A resource's version is a hash of its deterministic serialisation, so the same config and
  telemetry give the same versions on every replica and after a restart.
* Versions are per resource: EDS is versioned per cluster, so a weight change touches only the
  ClusterLoadAssignments that changed.
* Each resource is serialised once; its response fields (SotW and Delta) are encoded lazily once
  and shared by every stream that sends that version.
* `build_snapshot` refuses an inconsistent set (a dangling EDS/RDS/cluster reference) with
  `InconsistentSnapshotError`; the cache then keeps the last good snapshot.
* Each type's resources are in name order. A published snapshot also records, per type, which
  names changed since the one it replaced (`changes`), so that a stream already up to date with
  that one looks only at those names; what a subscription to some names wants, and its version,
  is computed once per snapshot (`subset`) and shared by every stream with that subscription.
  That memo is keyed by names the snapshot has (a stream passes its subscription's intersection
  with `names_of`), never by a client's raw name set, and bounded in bytes (`SubsetMemo`), so
  what a client subscribes to is held by its stream only and freed when the stream closes.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.extensions.clusters.aggregate.v3 import cluster_pb2 as aggregate_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from google.protobuf.message import Message

from xds_server.xds import encode as wire
from xds_server.xds import type_urls

_HCM_TYPE = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"


class InconsistentSnapshotError(ValueError):
    """Our own fault: the snapshot we built references resources it does not contain."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("inconsistent snapshot: " + "; ".join(problems))


def content_hash(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()[:16]


def resource_name(message: Message) -> str:
    if isinstance(message, endpoint_pb2.ClusterLoadAssignment):
        return message.cluster_name
    return str(message.name)


@dataclass(frozen=True, eq=False)
class Resource:
    """One xDS resource at one version. `payload` is its deterministic serialisation."""

    type_url: str
    name: str
    version: str
    payload: bytes
    message: Message = field(repr=False)

    @cached_property
    def sotw_field(self) -> bytes:
        return wire.sotw_resource_field(self.type_url, self.payload)

    @cached_property
    def delta_field(self) -> bytes:
        return wire.delta_resource_field(self.type_url, self.name, self.version, self.payload)


def make_resource(type_url: str, message: Message) -> Resource:
    payload = message.SerializeToString(deterministic=True)
    name = resource_name(message)
    return Resource(type_url, name, content_hash(type_url.encode(), payload), payload, message)


def type_version(resources: Mapping[str, Resource]) -> str:
    """The version of a set of resources: a hash of its sorted (name, version) pairs."""
    return content_hash(*(f"{name}={res.version}".encode() for name, res in sorted(resources.items())))


EMPTY_TYPE_VERSION = type_version({})
MAX_SUBSET_BYTES = 16 * 1024 * 1024  # memoised subsets per snapshot, as `SubsetMemo` counts them
_NO_RESOURCES: Mapping[str, Resource] = MappingProxyType({})
_NO_NAMES: frozenset[str] = frozenset()

SubsetKey = tuple[str, frozenset[str]]
SubsetValue = tuple[Mapping[str, Resource], str]
_ENTRY_OVERHEAD = 200  # the value tuple, the memo's own slot and node, the key tuple


def subset_entry_bytes(names: frozenset[str], value: SubsetValue) -> int:
    """What one memo entry holds in memory: the key set and its strings, the name -> resource
    dict and its view, the version (the Resources themselves belong to the snapshot)."""
    wanted, version = value
    return (sys.getsizeof(names) + sum(sys.getsizeof(name) for name in names)
            + sys.getsizeof(dict(wanted)) + sys.getsizeof(wanted) + sys.getsizeof(version)
            + _ENTRY_OVERHEAD)


class SubsetMemo:
    """`Snapshot.subset` results, least recently used first out, at most `max_bytes` in all
    (by `subset_entry_bytes`); an entry larger than that is not kept at all."""

    def __init__(self, max_bytes: int = MAX_SUBSET_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[SubsetKey, tuple[SubsetValue, int]] = OrderedDict()

    def get(self, key: SubsetKey) -> SubsetValue | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: SubsetKey, value: SubsetValue) -> None:
        size = subset_entry_bytes(key[1], value)
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class TypeChange:
    """What changed in one type from the previous snapshot to this one."""

    since: str  # the previous snapshot's version of the type
    names: frozenset[str]  # resources added, removed or with a new version


@dataclass(frozen=True)
class Snapshot:
    resources: Mapping[str, Mapping[str, Resource]]  # type -> name -> resource, in name order
    versions: Mapping[str, str]
    version: str
    changes: Mapping[str, TypeChange] = field(  # since the snapshot this one replaced
        default_factory=lambda: MappingProxyType({}), compare=False)
    # What the publisher built it from, opaque here (the controller's `envoy.views.ViewInputs`,
    # from which per-node views are computed): kept by `reusing`, never part of the version.
    source: object = field(default=None, compare=False, repr=False)
    _subsets: SubsetMemo = field(default_factory=SubsetMemo, init=False, repr=False,
                                 compare=False)
    _names: dict[str, frozenset[str]] = field(default_factory=dict, init=False, repr=False,
                                              compare=False)

    def of_type(self, type_url: str) -> Mapping[str, Resource]:
        return self.resources.get(type_url, _NO_RESOURCES)

    def names_of(self, type_url: str) -> frozenset[str]:
        """The names of `type_url`'s resources. The same object as the previous snapshot's
        when they did not change (see `reusing`), so a stream can tell cheaply."""
        names = self._names.get(type_url)
        if names is None:
            have = self.resources.get(type_url)
            names = self._names[type_url] = frozenset(have) if have else _NO_NAMES
        return names

    def type_version_of(self, type_url: str) -> str:
        """`type_version` of all the resources of `type_url` (precomputed)."""
        return self.versions.get(type_url, EMPTY_TYPE_VERSION)

    def subset(self, type_url: str, names: frozenset[str]) -> SubsetValue:
        """The resources of `type_url` among `names`, in name order, and their `type_version`:
        computed once per snapshot and name set, shared by every stream subscribing to it.
        Memoised only when the snapshot has every one of `names` (pass a subscription's
        intersection with `names_of`), so no name a client made up is ever kept here."""
        key = (type_url, names)
        found = self._subsets.get(key)
        if found is None:
            have = self.of_type(type_url)
            wanted = {name: have[name] for name in sorted(names) if name in have}
            found = (MappingProxyType(wanted), type_version(wanted))
            if len(wanted) == len(names):
                self._subsets.put(key, found)
        return found

    @property
    def subset_memo(self) -> SubsetMemo:
        return self._subsets

    def reusing(self, previous: Snapshot | None) -> Snapshot:
        """Return an equal snapshot that reuses `previous`'s Resource objects where the
        versions match, so their encoded bytes (already cached) are shared, not re-encoded,
        and that records what changed since `previous` (`changes`)."""
        if previous is None:
            return self
        merged: dict[str, Mapping[str, Resource]] = {}
        changes: dict[str, TypeChange] = {}
        for type_url in [*self.resources, *(t for t in previous.resources if t not in self.resources)]:
            items, changed = _reuse(self.of_type(type_url), previous.of_type(type_url))
            if type_url in self.resources:
                merged[type_url] = MappingProxyType(items)
            changes[type_url] = TypeChange(previous.type_version_of(type_url), frozenset(changed))
        out = Snapshot(MappingProxyType(merged), self.versions, self.version,
                       MappingProxyType(changes), self.source)
        for type_url in merged:
            before = previous.names_of(type_url)
            if changes[type_url].names <= before and out.names_of(type_url) == before:
                out._names[type_url] = before  # unchanged: streams keep their intersections
        return out


def _reuse(items: Mapping[str, Resource], old: Mapping[str, Resource]
           ) -> tuple[dict[str, Resource], set[str]]:
    """`items` with `old`'s equal-version objects in place, and the names that differ."""
    kept: dict[str, Resource] = {}
    changed: set[str] = set()
    for name, res in items.items():
        before = old.get(name)
        if before is not None and before.version == res.version:
            kept[name] = before
        else:
            kept[name] = res
            changed.add(name)
    changed.update(name for name in old if name not in items)
    return kept, changed


def _hcm_route_names(listener: listener_pb2.Listener) -> list[str]:
    names = []
    for chain in listener.filter_chains:
        for net_filter in chain.filters:
            typed = net_filter.typed_config
            if typed.type_url.endswith(_HCM_TYPE):
                hcm = hcm_pb2.HttpConnectionManager()
                typed.Unpack(hcm)
                if hcm.HasField("rds"):
                    names.append(hcm.rds.route_config_name)
    return names


def _route_clusters(route_config: route_pb2.RouteConfiguration) -> list[str]:
    names = []
    for vhost in route_config.virtual_hosts:
        for route in vhost.routes:
            if not route.HasField("route"):
                continue
            action = route.route
            if action.cluster:
                names.append(action.cluster)
            names.extend(wc.name for wc in action.weighted_clusters.clusters)
    return names


def _aggregate_members(cluster: cluster_pb2.Cluster) -> list[str]:
    if cluster.cluster_type.name != "envoy.clusters.aggregate":
        return []
    config = aggregate_pb2.ClusterConfig()
    cluster.cluster_type.typed_config.Unpack(config)
    return list(config.clusters)


def _eds_name(cluster: cluster_pb2.Cluster) -> str | None:
    if cluster.type != cluster_pb2.Cluster.EDS:
        return None
    return cluster.eds_cluster_config.service_name or cluster.name


def _dangling(kind: str, owner_type: str, owner: str, wanted: str, have: Mapping[str, Any]
              ) -> list[str]:
    if wanted in have:
        return []
    return [f"{owner_type} {owner!r} references {kind} {wanted!r}, which the snapshot lacks"]


def check_consistency(resources: Mapping[str, Mapping[str, Resource]]) -> list[str]:
    """go-control-plane's Consistent(): every EDS/RDS/cluster reference must resolve."""
    clusters = resources.get(type_urls.CLUSTER, {})
    problems: list[str] = []
    for name, res in clusters.items():
        eds = _eds_name(res.message)  # type: ignore[arg-type]
        if eds is not None:
            problems += _dangling("EDS", "cluster", name, eds, resources.get(type_urls.ENDPOINT, {}))
        for member in _aggregate_members(res.message):  # type: ignore[arg-type]
            problems += _dangling("cluster", "aggregate cluster", name, member, clusters)
    for name, res in resources.get(type_urls.LISTENER, {}).items():
        for route_name in _hcm_route_names(res.message):  # type: ignore[arg-type]
            problems += _dangling("RDS", "listener", name, route_name,
                                  resources.get(type_urls.ROUTE, {}))
    for name, res in resources.get(type_urls.ROUTE, {}).items():
        for cluster in _route_clusters(res.message):  # type: ignore[arg-type]
            problems += _dangling("cluster", "route config", name, cluster, clusters)
    return problems


def build_snapshot(messages: Mapping[str, Iterable[Message]], source: object = None) -> Snapshot:
    """Hash, check and freeze a set of resources (built from `source`, see `Snapshot.source`).
    Raises InconsistentSnapshotError."""
    resources: dict[str, Mapping[str, Resource]] = {}
    for type_url, items in messages.items():
        by_name: dict[str, Resource] = {}
        for message in items:
            res = make_resource(type_url, message)
            if not res.name or res.name in by_name:
                raise InconsistentSnapshotError([f"{type_urls.short_name(type_url)} resource "
                                                 f"name {res.name!r} is empty or duplicated"])
            by_name[res.name] = res
        resources[type_url] = MappingProxyType(dict(sorted(by_name.items())))
    problems = check_consistency(resources)
    if problems:
        raise InconsistentSnapshotError(problems)
    versions = {t: type_version(r) for t, r in sorted(resources.items())}
    overall = content_hash(*(f"{t}={v}".encode() for t, v in versions.items()))
    return Snapshot(MappingProxyType(resources), MappingProxyType(versions), overall,
                    source=source)
