"""Client certificate identities (`peer_identities`) and what one proves about a node
(`san_binding`, `dns_claim`): the SAN matching rules of docs/security.md."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:  # the rules are plain functions: checking a config imports no grpc
    import grpc


def _decoded(values: Iterable[bytes]) -> list[str]:
    return [value.decode("utf-8", "replace") for value in values]


def peer_identities(context: grpc.aio.ServicerContext) -> list[str]:
    """The verified client certificate's identities: URI SANs, then DNS SANs (grpcio 1.85's
    ``peer_uri``/``peer_dns`` auth-context keys); else the mixed
    ``x509_subject_alternative_name`` list (IP SANs too); the subject CN (``x509_common_name``)
    only for a certificate without SANs. Empty without TLS or without a client certificate
    (grpcio requests one only with require_client_cert)."""
    auth = context.auth_context() or {}
    identities = _decoded(auth.get("peer_uri", ())) + _decoded(auth.get("peer_dns", ()))
    if not identities:
        identities = _decoded(auth.get("x509_subject_alternative_name", ()))
    if not identities:
        identities = _decoded(auth.get("x509_common_name", ()))
    return identities


def _path_claims(segments: list[str]) -> tuple[str | None, str | None]:
    """(cluster, node) named by ``.../cluster/<c>/...`` and ``.../node/<id>`` segments."""
    cluster = node = None
    for key, value in zip(segments, segments[1:], strict=False):
        if key == "cluster" and cluster is None:
            cluster = value
        elif key == "node" and node is None:
            node = value
    return cluster, node


Binding = Literal["node", "cluster", "both"]


def _uri_binding(uri: str, node_id: str, node_cluster: str,
                 trust_domain: str | None) -> Binding | None:
    parts = urlsplit(uri)
    if trust_domain is not None and (parts.scheme != "spiffe" or parts.netloc != trust_domain):
        return None
    segments = [unquote(s) for s in parts.path.split("/") if s]
    keys = segments[:-1]
    if keys.count("cluster") > 1 or keys.count("node") > 1:
        return None  # names a cluster or a node twice: which one would be ambiguous
    cluster, node = _path_claims(segments)
    if (cluster is not None and cluster != node_cluster) or (node is not None and node != node_id):
        return None  # the certificate names another cluster or another node
    node_ok = node == node_id or (node is None and cluster is None and bool(segments)
                                  and segments[-1] == node_id)
    cluster_ok = cluster is not None and cluster == node_cluster
    return _binding(node_ok and bool(node_id), cluster_ok and bool(node_cluster))


def dns_claim(name: str, dns_suffix: str | None = None) -> tuple[str, str | None] | None:
    """The (node id, node cluster or None) a DNS SAN (or CN) names, or None if it names no
    node. One SAN maps to exactly one pair, whatever the node claims:

    lower-cased, one trailing dot dropped; with `dns_suffix`, the name must end in
    ``.<dns_suffix>``, which is removed (without it nothing is removed); what is left must be
    dot-separated non-empty labels without ``*``; its *first label* is the node id and
    *all the remaining labels* are the node cluster (``n1.prod.eu``: node ``n1``, cluster
    ``prod.eu``). A single label names the node id only. A node id with a dot therefore
    cannot be named by a DNS SAN (use a URI SAN)."""
    name = name.lower()
    name = name[:-1] if name.endswith(".") else name
    if dns_suffix:
        suffix = "." + dns_suffix.lower().strip(".")
        if not name.endswith(suffix):
            return None
        name = name[: -len(suffix)]
    labels = name.split(".")
    if not all(labels) or "*" in name:
        return None
    return labels[0], ".".join(labels[1:]) or None


def _dns_binding(name: str, node_id: str, node_cluster: str,
                 dns_suffix: str | None = None) -> Binding | None:
    claim = dns_claim(name, dns_suffix)
    if claim is None or not node_id or claim[0] != node_id.lower():
        return None
    if claim[1] is None:
        return "node"
    return "both" if node_cluster and claim[1] == node_cluster.lower() else None


def _binding(node_ok: bool, cluster_ok: bool) -> Binding | None:
    if node_ok and cluster_ok:
        return "both"
    return "node" if node_ok else "cluster" if cluster_ok else None


def san_binding(identity: str, node_id: str, node_cluster: str,
                trust_domain: str | None = None,
                dns_suffix: str | None = None) -> Binding | None:
    """What a certificate identity proves about a node: ``"both"`` (id and cluster),
    ``"node"`` (the id only), ``"cluster"`` (the cluster only) or None (no match).

    URI SAN (contains ``://``), path segments percent-decoded:
      * ``.../cluster/<c>/...`` must equal the node cluster and ``.../node/<id>/...`` the node
        id when present; naming another cluster or node never matches;
      * ``/cluster/<c>/node/<id>`` proves both; ``/cluster/<c>`` alone the cluster;
        ``/node/<id>`` the id; without either keyword, a last segment equal to the node id
        proves the id (``spiffe://td/ns/default/sa/envoy-1``);
      * a URI with two ``cluster`` or two ``node`` keyword segments names nothing;
      * with `trust_domain`, only ``spiffe://<trust_domain>/...`` URIs count.
    DNS SAN (or a CN), case-insensitive, trailing dot ignored, parsed by `dns_claim`
    (first label: the id; every other label: the cluster; `dns_suffix` removed first):
    ``<id>.<cluster>`` proves both when *both* are exactly the node's; ``<id>`` alone proves
    the id. ``n1.prod.eu`` is node ``n1`` of cluster ``prod.eu``: never of cluster ``prod``,
    nor node ``n1.prod`` of cluster ``eu``. No wildcards."""
    if "://" in identity:
        return _uri_binding(identity, node_id, node_cluster, trust_domain)
    return _dns_binding(identity, node_id, node_cluster, dns_suffix)
