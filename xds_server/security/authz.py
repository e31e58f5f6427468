"""Node authorisation: a node's cluster selects the pools it may see (``nodes.clusters``), and
with ``require_san_match`` its client certificate must name it (`identity.san_binding`).
A node that fails gets PERMISSION_DENIED (see `guard.XdsGuard`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from xds_server.config.schema import ANY
from xds_server.security.identity import san_binding

if TYPE_CHECKING:  # the authorisation table imports neither grpc nor protos
    from envoy.config.core.v3 import base_pb2


@dataclass(frozen=True)
class Decision:
    allowed: bool
    pools: frozenset[str] | None  # None: every pool (no filtering)
    reason: str
    identity: str | None = None  # the certificate identity that matched


class NodesSettings(Protocol):
    """What `NodeAuthorizer.from_config` reads (the `nodes:` config section)."""

    @property
    def clusters(self) -> Mapping[str, Sequence[str]]: ...
    @property
    def require_san_match(self) -> bool: ...
    @property
    def require_cluster_binding(self) -> bool: ...
    @property
    def trust_domain(self) -> str | None: ...
    @property
    def dns_suffix(self) -> str | None: ...


@dataclass(frozen=True)
class NodeAuthorizer:
    """Node cluster -> allowed pools (None: every pool), plus the SAN policy."""

    clusters: Mapping[str, frozenset[str] | None] = field(
        default_factory=lambda: MappingProxyType({ANY: None}))
    require_san_match: bool = False
    require_cluster_binding: bool = False  # a SAN must prove the cluster, not only the id
    trust_domain: str | None = None
    dns_suffix: str | None = None  # removed from DNS SANs before `dns_claim` parses them

    @classmethod
    def from_mapping(cls, clusters: Mapping[str, Sequence[str]], **policy: Any) -> NodeAuthorizer:
        table = {name: None if ANY in pools else frozenset(pools)
                 for name, pools in clusters.items()}
        return cls(MappingProxyType(table), **policy)

    @classmethod
    def from_config(cls, nodes: NodesSettings | None) -> NodeAuthorizer:
        """`nodes: None` (the section absent) allows every node every pool."""
        if nodes is None:
            return cls()
        return cls.from_mapping(nodes.clusters, require_san_match=nodes.require_san_match,
                                require_cluster_binding=nodes.require_cluster_binding,
                                trust_domain=nodes.trust_domain,
                                dns_suffix=getattr(nodes, "dns_suffix", None))

    def pools_for(self, node_cluster: str) -> tuple[bool, frozenset[str] | None]:
        if node_cluster in self.clusters:
            return True, self.clusters[node_cluster]
        if ANY in self.clusters:
            return True, self.clusters[ANY]
        return False, None

    def authorize(self, node: base_pb2.Node | None, identities: Sequence[str]) -> Decision:
        if node is None:
            return Decision(False, None, "the stream's first request carried no node")
        known, pools = self.pools_for(node.cluster)
        if not known:
            return Decision(False, None, f"node cluster {node.cluster!r} is not in "
                                         f"nodes.clusters (and there is no '*' entry)")
        if not self.require_san_match:
            return Decision(True, pools, f"node cluster {node.cluster!r}")
        if not identities:
            return Decision(False, None, "no client certificate identity: require_san_match "
                                         "needs mTLS with a certificate that has SANs")
        wanted = ("both", "cluster") if self.require_cluster_binding else ("both", "cluster",
                                                                          "node")
        for identity in identities:
            if san_binding(identity, node.id, node.cluster, self.trust_domain,
                           self.dns_suffix) in wanted:
                return Decision(True, pools, f"certificate {identity!r} matches node "
                                             f"{node.id!r} of cluster {node.cluster!r}", identity)
        what = "node cluster" if self.require_cluster_binding else "node id nor node cluster"
        return Decision(False, None, f"certificate identities {list(identities)} match neither "
                                     f"the {what} of node {node.id!r} (cluster {node.cluster!r})")
