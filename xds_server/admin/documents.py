"""The admin API's JSON documents, built from what the controller and the xDS servicer hold:
``/v1/weights`` (the weights, their inputs and the breakdown `trimtab weights` shows),
``/v1/snapshot`` (what each connected stream was sent and ACKed), ``/v1/nacks`` and
``/v1/config``, ``/v1/admission`` (each pool's budget in force and what the Envoys' load
reports say they admitted and refused). Pure: no HTTP and no threads here.

The ``encode_*`` functions return the document's bytes, or :class:`~.encoding.TooLarge` when
it is over its limit; they read only what they are handed (immutable inputs, or copies taken
on the event loop: :func:`stream_rows`), so the admin thread can run them
(``admin/builds.py``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weight_calculator.health import Health
from weight_calculator.localities import document_shares
from weight_calculator.types import EndpointWeight, PoolWeights
from xds_server.admin.encoding import (
    Encoded,
    TooLarge,
    bounded,
    dumps,
    join_array,
    join_object,
    within_budget,
)
from xds_server.config.pools import EndpointConfig, PoolConfig
from xds_server.config.schema import Config
from xds_server.control.admission import AdmissionState
from xds_server.control.controller import Controller
from xds_server.control.explain import breakdown_document
from xds_server.xds import type_urls
from xds_server.xds.lrs import ClusterView
from xds_server.xds.server import XdsServicer
from xds_server.xds.snapshot import Snapshot

Weights = Mapping[str, PoolWeights]  # cluster -> its weights, as the controller holds them
POOL_NAMES_IN_HINT = 10
SLICE_SECONDS = 0.005  # the longest the loop copies streams before it serves again


# -- /v1/weights ---------------------------------------------------------------------------


def weights_document(controller: Controller) -> dict[str, Any]:
    """The `/v1/weights` JSON as a dict (see :func:`encode_weights` for the bytes served)."""
    config, weights = controller.config, controller.weights
    pools = {pool.name: _endpoint_documents(pool, weights) for pool in config.pools}
    return {"pools": pools, **_cluster_parts(config.pools, weights)}


def weights_summary(config: Config, weights: Weights) -> dict[str, Any]:
    """Each endpoint's weight and staleness only, shaped like `/v1/weights` (for the history)."""
    pools: dict[str, Any] = {}
    for pool in config.pools:
        endpoints = {}
        for address, (_, ew, _, _, _) in _endpoint_rows(pool, weights):
            endpoints[address] = {"weight": ew.weight if ew else 1,
                                  "stale": ew.stale if ew else True}
        pools[pool.name] = endpoints
    return {"pools": pools}


def encode_weights(config: Config, weights: Weights, pool: str | None, limit: int) -> Encoded:
    """The `/v1/weights` bytes, every pool's or one pool's (``?pool=``): pools -> address ->
    weight, stale, signals, updated_at, the input problems and the breakdown; the clusters
    that are fail-static; each cluster's localities (capacity tiers) and their weights."""
    pools = [p for p in config.pools if pool is None or p.name == pool]
    parts = _cluster_parts(pools, weights)
    body = join_object([
        ("fail_static_pools", dumps(parts["fail_static_pools"])),
        ("localities", dumps(parts["localities"])),
        ("pools", join_object((p.name, _encode_pool(p, weights))
                              for p in sorted(pools, key=lambda p: p.name))),
    ])
    return bounded("/v1/weights", body, limit, _weights_hint(config, pool))


def _weights_hint(config: Config, pool: str | None) -> str:
    if pool is not None:
        return ("GET /metrics for each endpoint's weight alone "
                "(trimtab_endpoint_weight)")
    names = [p.name for p in config.pools]
    shown = ", ".join(names[:POOL_NAMES_IN_HINT]) + (", ..." if len(names) > POOL_NAMES_IN_HINT
                                                     else "")
    return f"ask for one pool with ?pool=NAME (pools: {shown})"


def _encode_pool(pool: PoolConfig, weights: Weights) -> bytes:
    endpoints = {address: dumps(document)
                 for address, document in _endpoint_documents(pool, weights).items()}
    return join_object(sorted(endpoints.items()))


def _endpoint_documents(pool: PoolConfig, weights: Weights) -> dict[str, dict[str, Any]]:
    """address -> its document, with ``share``: the part of its cluster's new requests Envoy
    gives it (locality weight x host weight, priorities and EDS health included:
    :func:`weight_calculator.localities.document_shares`)."""
    documents = {address: _endpoint_document(*row)
                 for address, row in _endpoint_rows(pool, weights)}
    clusters: dict[str, dict[str, dict[str, Any]]] = {}
    for address, document in documents.items():
        clusters.setdefault(document["cluster"], {})[address] = document
    for members in clusters.values():
        for address, share in document_shares(members).items():
            members[address]["share"] = round(share, 4)
    return documents


EndpointRow = tuple[EndpointConfig, EndpointWeight | None, str, str, int | None]


def _endpoint_rows(pool: PoolConfig, weights: Weights) -> list[tuple[str, EndpointRow]]:
    """(address, (endpoint, its weight, cluster, version, locality weight)); a later cluster's
    endpoint replaces an earlier one's at the same address."""
    rows = []
    for cluster, version, members in pool.clusters():
        computed = weights.get(cluster)
        for endpoint in members:
            ew = computed.endpoints.get(endpoint.address) if computed else None
            locality = (computed.localities.get(ew.locality, 1)
                        if ew is not None and ew.locality and computed is not None else None)
            rows.append((endpoint.address, (endpoint, ew, cluster, version, locality)))
    return rows


def _cluster_parts(pools: Sequence[PoolConfig], weights: Weights) -> dict[str, Any]:
    clusters = {cluster for pool in pools for cluster, _, _ in pool.clusters()}
    mine = {c: w for c, w in weights.items() if c in clusters}
    return {"fail_static_pools": sorted(c for c, w in mine.items() if w.fail_static),
            # cluster -> locality (capacity tier) -> its EDS load_balancing_weight
            "localities": {c: dict(w.localities) for c, w in sorted(mine.items())
                           if w.localities}}


def _endpoint_document(endpoint: EndpointConfig, ew: EndpointWeight | None, cluster: str,
                       version: str, locality_weight: int | None) -> dict[str, Any]:
    document = {
        "weight": ew.weight if ew else 1,
        "stale": ew.stale if ew else True,
        "saturated": ew.saturated if ew else True,
        "drain": endpoint.drain,
        "signals": dict(ew.signals) if ew else {},
        "updated_at": ew.updated_at if ew else None,
        "reason": ew.reason if ew else "no telemetry yet",
        "cluster": cluster,
        "version": version,
        "health": ew.health if ew else Health.STALE,
        "locality": ew.locality if ew else None,
        "problems": list(ew.problems) if ew else [],
        "breakdown": breakdown_document(endpoint, ew),
    }
    if locality_weight is not None:
        document["locality_weight"] = locality_weight
    return document


# -- /v1/snapshot --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamRow:
    """One connected stream as the admin thread encodes it: copied on the loop, which goes
    on changing the stream's own state."""

    node: str  # as its first request claimed it
    peer: str
    identities: list[str]
    api: str
    service: str
    types: dict[str, dict[str, Any]]  # short type name -> acked, pending nonce, wildcard, sent


async def stream_rows(servicer: XdsServicer | None, node: str | None = None) -> list[StreamRow]:
    """The connected streams (only ``node``'s when given), copied on the event loop, which
    serves again every :data:`SLICE_SECONDS` meanwhile."""
    rows = []
    since = time.perf_counter()
    for info in list(servicer.streams if servicer else []):
        if time.perf_counter() - since > SLICE_SECONDS:
            await asyncio.sleep(0)
            since = time.perf_counter()
        if node is not None and info.node_id != node:
            continue
        types = {type_urls.short_name(type_url): {
            "acked_version": state.acked_version, "pending_nonce": state.pending_nonce,
            "wildcard": state.wildcard, "resources": dict(state.sent)}
            for type_url, state in info.machine.types.items()}
        rows.append(StreamRow(info.node_id, info.peer, info.identities, info.api,
                              info.service, types))
    return rows


def _stream_document(row: StreamRow) -> dict[str, Any]:
    return {"node": row.node, "peer": row.peer, "identities": row.identities, "api": row.api,
            "service": row.service, "types": row.types}


def current_document(current: Snapshot | None) -> dict[str, Any] | None:
    """The published snapshot's version and, per type, its version and resource versions."""
    if current is None:
        return None
    return {"version": current.version, "types": {
        type_urls.short_name(t): {"version": current.versions[t], "resources": {
            name: res.version for name, res in current.of_type(t).items()}}
        for t in current.resources}}


def encode_snapshot(rows: list[StreamRow], current: Snapshot | None, limit: int) -> Encoded:
    """The `/v1/snapshot` bytes: the current snapshot, then as many streams (ordered by node,
    then peer) as fit ``limit``; ``left_out`` (present only then) counts the others."""
    head = dumps(current_document(current))
    budget = limit - len(head) - 256  # the keys, the brackets and the hint
    if budget <= 0:
        return TooLarge("/v1/snapshot", len(head), limit,
                        "the current snapshot's resource list alone is over it")
    streams = [dumps(_stream_document(row))
               for row in sorted(rows, key=lambda r: (r.node, r.peer))]
    fits = within_budget(streams, budget)
    return join_object([
        ("current", head), *_left_out(fits.left_out, "streams",
                                      "ask for one node's streams with ?node=ID"),
        ("streams", join_array(fits.kept))])


def _left_out(count: int, what: str, hint: str) -> list[tuple[str, bytes]]:
    """``left_out`` and ``left_out_hint``, only when something was left out."""
    if not count:
        return []
    return [("left_out", dumps(count)),
            ("left_out_hint", dumps(f"{count} {what} left out to stay within the "
                                    f"document's byte limit; {hint}"))]


# -- /v1/nacks, /v1/config -----------------------------------------------------------------


def encode_nacks(total: int, recent: list[dict[str, Any]], limit: int) -> Encoded:
    """The `/v1/nacks` bytes: the count of every NACK, and the most recent records (newest
    first) that fit ``limit``; ``left_out`` (present only then) counts the older ones held
    but not shown."""
    fits = within_budget([dumps(record) for record in recent], max(0, limit - 256))
    return join_object([*_left_out(fits.left_out, "NACK records",
                                   "the newest are shown; the trimtab log has each NACK"),
                        ("recent", join_array(fits.kept)), ("total", dumps(total))])


def encode_config(config: Config, limit: int) -> Encoded:
    """The `/v1/config` bytes: the effective config (discovered endpoints included), pool by
    pool."""
    top = config.model_dump(mode="json", exclude={"pools"})
    pools = join_array(pool.model_dump_json().encode() for pool in config.pools)
    body = join_object(sorted([*((key, dumps(value)) for key, value in top.items()),
                               ("pools", pools)]))
    return bounded("/v1/config", body, limit, "the config file and the discovery log have it")


# -- /v1/admission -------------------------------------------------------------------------


def _envoy_load(view: ClusterView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    return {"issued": view.issued, "dropped": view.dropped, "in_progress": view.in_progress,
            "issued_per_s": round(view.issued_per_s, 3),
            "dropped_per_s": round(view.dropped_per_s, 3), "reporting": view.envoys,
            # per endpoint ("ip:port"): what the reporting Envoys sent it, as rates and levels
            "endpoints": {address: {"issued_per_s": round(e.issued_per_s, 3),
                                    "errors_per_s": round(e.errors_per_s, 3),
                                    "in_progress": e.in_progress, "reporting": e.envoys}
                          for address, e in view.endpoints.items()}}


def admission_document(config: Config, state: AdmissionState,
                       load: Mapping[str, ClusterView]) -> dict[str, Any]:
    """Per pool and cluster: the budget in force (the ``trimtab_admission_*`` gauges'
    values; ``budget`` null: nothing measured, everything admitted) and ``envoy``, what the
    Envoys' load reports (LRS) count: ``issued`` (admitted) and ``dropped`` (refused) since
    trimtab started, their rates over the latest reports, and what is in flight (null: no
    Envoy has reported on the cluster), and per endpoint the rates and levels of the latest
    reports (``endpoints``)."""
    limits = state.limits(config)
    pools: dict[str, Any] = {}
    for pool in config.pools:
        clusters: dict[str, Any] = {}
        for cluster, version, _ in pool.clusters():
            budget, limit, cap = (state.budgets.get(cluster), limits.get(cluster),
                                  state.tenants.get(cluster))
            clusters[cluster] = {
                "version": version,
                "budget": budget.in_flight if budget is not None else None,
                "limit": ({"interactive": limit.interactive, "batch": limit.batch}
                          if limit is not None else None),
                "envoys": state.envoys.get(cluster, 1) if limit is not None else None,
                "tenant_rate": cap.rate if cap is not None else None,
                "tenant_enforced": cap.enforced if cap is not None else None,
                "envoy": _envoy_load(load.get(cluster)),
            }
        pools[pool.name] = {"slo_ttft_seconds": pool.slo.ttft_seconds,
                            "spill": state.spill.get(pool.name, 0) / 1000,
                            "clusters": clusters}
    return {"pools": pools}


def encode_admission(config: Config, state: AdmissionState, load: Mapping[str, ClusterView],
                     limit: int) -> Encoded:
    """The `/v1/admission` bytes (every pool's), or TooLarge."""
    body = dumps(admission_document(config, state, load))
    return bounded("/v1/admission", body, limit,
                   "the trimtab_admission_* and trimtab_envoy_* metrics have the same values")
