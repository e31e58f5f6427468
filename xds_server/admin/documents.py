"""The admin API's JSON documents, built from what the controller and the xDS servicer hold:
``/v1/weights`` (the weights, their inputs and the breakdown `trimtab weights` shows) and
``/v1/snapshot`` (what each connected stream was sent and ACKed). Pure: no HTTP here."""

from __future__ import annotations

from typing import Any

from weight_calculator.health import Health
from weight_calculator.types import EndpointWeight
from xds_server.config.pools import EndpointConfig
from xds_server.control.controller import Controller
from xds_server.control.explain import breakdown_document
from xds_server.xds import type_urls
from xds_server.xds.server import XdsServicer


def weights_document(controller: Controller) -> dict[str, Any]:
    """The `/v1/weights` JSON: pools -> address -> weight, stale, signals, updated_at, the
    input problems and the breakdown `trimtab weights` shows."""
    pools: dict[str, Any] = {}
    for pool in controller.config.pools:
        endpoints = {}
        for cluster, version, members in pool.clusters():
            computed = controller.weights.get(cluster)
            for endpoint in members:
                ew = computed.endpoints.get(endpoint.address) if computed else None
                endpoints[endpoint.address] = _endpoint_document(endpoint, ew, cluster, version)
                if ew is not None and ew.locality and computed is not None:
                    endpoints[endpoint.address]["locality_weight"] = computed.localities.get(
                        ew.locality, 1)
        pools[pool.name] = endpoints
    fail_static = sorted(p for p, w in controller.weights.items() if w.fail_static)
    # cluster -> locality (capacity tier) -> its EDS load_balancing_weight
    localities = {c: dict(w.localities) for c, w in sorted(controller.weights.items())
                  if w.localities}
    return {"pools": pools, "fail_static_pools": fail_static, "localities": localities}


def _endpoint_document(endpoint: EndpointConfig, ew: EndpointWeight | None, cluster: str,
                       version: str) -> dict[str, Any]:
    return {
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



def snapshot_document(servicer: XdsServicer | None) -> dict[str, Any]:
    """Per connected stream: node (as its first request claimed it), peer and certificate
    identities, API, and per type what was sent and ACKed."""
    streams = []
    for info in sorted(servicer.streams if servicer else [], key=lambda i: (i.node_id, i.peer)):
        types = {}
        for type_url, state in sorted(info.machine.types.items()):
            types[type_urls.short_name(type_url)] = {
                "acked_version": state.acked_version,
                "pending_nonce": state.pending_nonce,
                "wildcard": state.wildcard,
                "resources": dict(sorted(state.sent.items())),
            }
        streams.append({"node": info.node_id, "peer": info.peer,
                        "identities": info.identities, "api": info.api,
                        "service": info.service, "types": types})
    return {"streams": streams}
