"""Per-node views of a published snapshot: the part a node assigned some pools may see.

A view is a pure function of the snapshot being published and of what its routes were built
from (`ViewInputs`: the config and the canary percents), which the publisher attaches to the
snapshot (``build_snapshot(..., source=inputs)``): never of live state read later, so a view
cannot mix a snapshot with a config it was not built from.

It holds those pools' clusters (stable, canary, fallback aggregate, version aggregates, and
those of the pools they fall back or send a size class to), their CLAs, the listener, and a
RouteConfiguration built by `routes.build_route_config` for that sub-config from the same
inputs. `SnapshotViews` memoises views per (snapshot version, pool set), so every stream of a
node cluster shares one view and its encoded bytes, and routes per (inputs, pool set), so a
snapshot that only changed weights builds no route.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.envoy import request_features
from xds_server.envoy.admission import NO_ADMISSION, RouteAdmission
from xds_server.envoy.routes import build_route_config
from xds_server.xds import type_urls
from xds_server.xds.snapshot import (
    InconsistentSnapshotError,
    Resource,
    Snapshot,
    check_consistency,
    content_hash,
    make_resource,
    type_version,
)

log = logging.getLogger("trimtab.views")


@dataclass(frozen=True, eq=False)
class ViewInputs:
    """What a snapshot's RouteConfiguration was built from. The publisher replaces each of
    these when it changes and never mutates one, so `same_as` may compare identities."""

    config: Config
    canary_percent: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    admission: RouteAdmission = NO_ADMISSION

    def same_as(self, other: ViewInputs | None) -> bool:
        return (other is not None and other.config is self.config
                and other.canary_percent is self.canary_percent
                and other.admission is self.admission)


def pool_closure(config: Config, pools: Iterable[str]) -> set[str]:
    """`pools` (those that exist) plus every pool they fall back or send a size class to."""
    names = {pool.name for pool in config.pools}
    todo, seen = [p for p in pools if p in names], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [dep for dep in config.pool(name).dependencies() if dep in names]
    return seen


def pool_clusters(pool: PoolConfig) -> set[str]:
    """Every Envoy cluster trimtab derives for `pool`: stable, canary, fallback aggregate."""
    names = {name for name, _, _ in pool.clusters()}
    if pool.fallback is not None:
        names.add(pool.fallback_cluster)
    names.update(request_features.version_clusters(pool))
    return names


def view_config(config: Config, pools: Iterable[str]) -> Config:
    """`config` with only the pools of `pool_closure(config, pools)`, in config order."""
    kept = pool_closure(config, pools)
    return config.model_copy(update={"pools": [p for p in config.pools if p.name in kept]})


def view_route(inputs: ViewInputs, pools: frozenset[str]) -> Resource:
    """The RouteConfiguration of the view of `pools`: routed as a trimtab with only them."""
    sub_config = view_config(inputs.config, pools)
    return make_resource(type_urls.ROUTE, build_route_config(sub_config, inputs.canary_percent,
                                                             admission=inputs.admission))


def _only(items: Mapping[str, Resource], names: set[str]) -> Mapping[str, Resource]:
    return MappingProxyType({name: res for name, res in items.items() if name in names})


def filter_snapshot(snapshot: Snapshot, pools: frozenset[str], inputs: ViewInputs,
                    previous: Snapshot | None = None, route: Resource | None = None
                    ) -> Snapshot:
    """The view of `snapshot` for a node assigned `pools`, `inputs` being what `snapshot` was
    built from. Cluster and CLA Resource objects are the snapshot's own (their encoded bytes
    are shared); the route is reused from `previous` (the pool set's last view) when
    unchanged. `route`: `view_route(inputs, pools)`, when the caller has it already. Raises
    InconsistentSnapshotError (the inputs and the snapshot out of step)."""
    sub_config = view_config(inputs.config, pools)
    clusters = set().union(*(pool_clusters(p) for p in sub_config.pools))
    clusters |= request_features.extra_cluster_names(sub_config)
    resources: dict[str, Mapping[str, Resource]] = {}
    for type_url, items in snapshot.resources.items():
        if type_url in (type_urls.CLUSTER, type_urls.ENDPOINT):
            resources[type_url] = _only(items, clusters)
        elif type_url != type_urls.ROUTE:
            resources[type_url] = items
    route = route if route is not None else view_route(inputs, pools)
    resources[type_urls.ROUTE] = MappingProxyType({route.name: route})
    problems = check_consistency(resources)
    missing = sorted(clusters - set(resources.get(type_urls.CLUSTER, {})))
    if missing:
        problems.append(f"clusters {missing} of pools {sorted(p.name for p in sub_config.pools)} "
                        f"are not in the snapshot")
    if problems:
        raise InconsistentSnapshotError(problems)
    versions = {t: type_version(r) for t, r in sorted(resources.items())}
    overall = content_hash(*(f"{t}={v}".encode() for t, v in versions.items()))
    view = Snapshot(MappingProxyType(resources), MappingProxyType(versions), overall)
    return view.reusing(previous)


class SnapshotViews:
    """Views cached per (snapshot version, pool set): N streams of one node cluster share one
    view and its encoded bytes. A view that cannot be built (a snapshot published without its
    `ViewInputs`, or inconsistent with them) is refused and the pool set's last good view is
    served (None before the first good one)."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self.built = 0
        self.routes_built = 0
        self.refused = 0
        self._views: OrderedDict[tuple[str, frozenset[str]], Snapshot] = OrderedDict()
        self._last: dict[frozenset[str], Snapshot] = {}
        self._routes: dict[frozenset[str], tuple[ViewInputs, Resource]] = {}

    def get(self, snapshot: Snapshot, pools: frozenset[str]) -> Snapshot | None:
        key = (snapshot.version, pools)
        view = self._views.get(key)
        if view is not None:
            self._views.move_to_end(key)
            return view
        inputs = snapshot.source
        if not isinstance(inputs, ViewInputs):
            return self._refuse(pools, f"snapshot {snapshot.version} was published without "
                                       f"the inputs its routes were built from")
        try:
            view = filter_snapshot(snapshot, pools, inputs, self._last.get(pools),
                                   self._route(inputs, pools))
        except InconsistentSnapshotError as exc:
            return self._refuse(pools, str(exc))
        self.built += 1
        self._views[key] = self._last[pools] = view
        while len(self._views) > self.max_entries:
            self._views.popitem(last=False)
        return view

    def _route(self, inputs: ViewInputs, pools: frozenset[str]) -> Resource:
        held = self._routes.get(pools)
        if held is not None and inputs.same_as(held[0]):
            return held[1]
        route = view_route(inputs, pools)
        self.routes_built += 1
        self._routes[pools] = (inputs, route)
        return route

    def _refuse(self, pools: frozenset[str], reason: str) -> Snapshot | None:
        self.refused += 1
        log.error("refusing the view for pools %s, keeping the last good one: %s",
                  sorted(pools), reason)
        return self._last.get(pools)
