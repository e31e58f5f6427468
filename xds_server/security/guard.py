"""Security for the xDS port and the admin API: TLS/mTLS, node authorisation, per-node views of
the snapshot, an admin bearer token, and request/stream limits.

Everything here is a library; `transport`/`app`/`admin` call it (see docs/security.md).

Node authorisation, in one paragraph: a node's *cluster* (``node.cluster``) selects the pools it
may see (``nodes.clusters``; ``"*"`` is the default entry). With ``require_san_match`` the
client certificate (mTLS) must name that node: one of its SANs must match the node id or the
node cluster by the rules of `san_binding`. A node that fails gets PERMISSION_DENIED. An
authorised node receives a *view* of the snapshot holding only its pools (`filter_snapshot`),
cached per (snapshot version, pool set) so every stream of that node cluster shares one view and
its encoded bytes.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2

from xds_server.config.schema import Config, PoolConfig
from xds_server.envoy import request_features
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

log = logging.getLogger("trimtab.security")

ANY = "*"  # as a node-cluster key: every cluster not listed; in a pool list: every pool


# -- TLS credentials -------------------------------------------------------------------------


class TlsConfigError(ValueError):
    """A TLS file that cannot be used; the message names the file and the problem."""


def _read_pem(path: str, what: str, marker: bytes) -> bytes:
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise TlsConfigError(f"{what} file {path!r} does not exist") from None
    except IsADirectoryError:
        raise TlsConfigError(f"{what} file {path!r} is a directory") from None
    except OSError as exc:
        raise TlsConfigError(f"{what} file {path!r} cannot be read: {exc.strerror}") from None
    if b"-----BEGIN " not in data or marker not in data:
        raise TlsConfigError(f"{what} file {path!r} holds no PEM {marker.decode()} block")
    return data


def _no_passphrase() -> str:
    raise TlsConfigError("encrypted private keys are not supported")


def _check_pair(cert_file: str, key_file: str, client_ca_file: str | None) -> None:
    """Let OpenSSL (stdlib ssl) parse the files: a bad PEM or a key that does not belong to
    the certificate fails here, at startup, instead of in every later handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except TlsConfigError as exc:
        raise TlsConfigError(f"private key file {key_file!r}: {exc}") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise TlsConfigError(f"private key file {key_file!r} does not match certificate "
                                 f"file {cert_file!r}") from None
        raise TlsConfigError(f"certificate file {cert_file!r} or private key file "
                             f"{key_file!r} is invalid: {exc.reason or exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except ssl.SSLError as exc:
            raise TlsConfigError(f"client CA file {client_ca_file!r} is invalid: "
                                 f"{exc.reason or exc}") from None


def _load_tls(cert_file: str, key_file: str, client_ca_file: str | None
              ) -> tuple[bytes, bytes, bytes | None]:
    """(key, certificate chain, client CA) PEM bytes, checked. Raises TlsConfigError."""
    cert = _read_pem(cert_file, "certificate", b"CERTIFICATE")
    key = _read_pem(key_file, "private key", b"PRIVATE KEY")
    ca = _read_pem(client_ca_file, "client CA", b"CERTIFICATE") if client_ca_file else None
    _check_pair(cert_file, key_file, client_ca_file)
    return key, cert, ca


def server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None,
                       require_client_cert: bool = False, *,
                       reload: bool = False) -> grpc.ServerCredentials:
    """TLS, or with `require_client_cert` mTLS, credentials for the xDS gRPC port.

    mTLS refuses, in the handshake, a client without a certificate signed by
    `client_ca_file`. grpcio cannot ask for an *optional* client certificate: without
    `require_client_cert` none is requested (so no peer identities), hence `client_ca_file`
    alone is refused as a likely mistake. Raises TlsConfigError naming the file and the
    problem.

    With `reload`, the files are re-read when they change (checked at each new TLS
    handshake), so a rotated certificate or CA applies to new connections without a restart;
    a broken rotation is logged and the previous files stay in use."""
    if require_client_cert != (client_ca_file is not None):
        raise TlsConfigError("require_client_cert and client_ca_file (the CA that signs the "
                             "Envoys' certificates) go together: grpcio cannot request an "
                             "optional client certificate")
    key, cert, ca = _load_tls(cert_file, key_file, client_ca_file)
    if not reload:
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=require_client_cert)
    watcher = CertificateWatcher(cert_file, key_file, client_ca_file)
    initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
    return grpc.dynamic_ssl_server_credentials(initial, watcher,
                                               require_client_authentication=require_client_cert)


def _file_state(path: str) -> tuple[int, int, int]:
    info = Path(path).stat()  # follows symlinks: a Kubernetes secret swap changes the inode
    return info.st_ino, info.st_mtime_ns, info.st_size


class CertificateWatcher:
    """grpc's certificate-configuration fetcher: called (on a gRPC thread) at each new
    handshake; returns a new configuration once the files changed and load cleanly."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None) -> None:
        self.files = (cert_file, key_file, client_ca_file)
        self.loaded = self._state()
        self.failed: tuple | None = None
        self.reloads = 0

    def _state(self) -> tuple:
        return tuple(_file_state(f) for f in self.files if f is not None)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        state: tuple | None = None  # None: a file is missing (mid-rotation)
        try:
            state = self._state()
            if state == self.loaded:
                return None
            key, cert, ca = _load_tls(*self.files)
        except (OSError, TlsConfigError) as exc:
            if state != self.failed:  # log a broken rotation once, keep serving the old files
                log.error("TLS files changed but cannot be used, keeping the previous ones: %s",
                          exc)
                self.failed = state
            return None
        self.loaded, self.failed, self.reloads = state, None, self.reloads + 1
        log.info("reloaded TLS certificate %s", self.files[0])
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


# -- peer identity ---------------------------------------------------------------------------


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


# -- node authorisation ----------------------------------------------------------------------


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


def node_pool_problems(clusters: Mapping[str, Sequence[str]], config: Config
                       ) -> list[tuple[str, str]]:
    """Config cross-checks for `nodes.clusters`: unknown pools, and pool sets that are not
    closed under fallback and prompt-size-class references (a node would get routes to
    clusters it is not given)."""
    names = {pool.name for pool in config.pools}
    problems = []
    folded: dict[str, str] = {}
    for cluster in clusters:  # a DNS SAN names a cluster case-insensitively
        other = folded.setdefault(cluster.lower(), cluster)
        if other != cluster:
            problems.append((f"nodes.clusters.{cluster}",
                             f"differs from node cluster {other!r} only in case: one DNS SAN "
                             f"would prove both"))
    for cluster, pools in clusters.items():
        path = f"nodes.clusters.{cluster}"
        for index, name in enumerate(pools):
            if name != ANY and name not in names:
                problems.append((f"{path}[{index}]", f"unknown pool {name!r}"))
        assigned = set(pools) & names
        if ANY in pools:
            continue
        for name in sorted(assigned):
            for dep in sorted(_dependencies(config.pool(name)) - assigned):
                problems.append((path, f"pool {name!r} sends traffic to pool {dep!r} "
                                       f"(fallback or size class); assign {dep!r} too"))
    return problems


# -- per-node snapshot views -----------------------------------------------------------------


def _dependencies(pool: PoolConfig) -> set[str]:
    deps = {size.pool for size in pool.size_classes()}
    deps |= request_features.targets(pool)
    if pool.fallback is not None:
        deps.add(pool.fallback)
    return deps - {pool.name}


def pool_closure(config: Config, pools: Iterable[str]) -> set[str]:
    """`pools` (those that exist) plus every pool they fall back or send a size class to."""
    names = {pool.name for pool in config.pools}
    todo, seen = [p for p in pools if p in names], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [dep for dep in _dependencies(config.pool(name)) if dep in names]
    return seen


def pool_clusters(pool: PoolConfig) -> set[str]:
    """Every Envoy cluster trimtab derives for `pool`: stable, canary, fallback aggregate."""
    names = {name for name, _, _ in pool.clusters()}
    if pool.fallback is not None:
        names.add(pool.fallback_cluster)
    names.update(request_features.version_clusters(pool))
    return names


def _only(items: Mapping[str, Resource], names: set[str]) -> Mapping[str, Resource]:
    return MappingProxyType({name: res for name, res in items.items() if name in names})


def filter_snapshot(snapshot: Snapshot, pools: frozenset[str], config: Config,
                    canary_percent: Mapping[str, float] | None = None,
                    previous: Snapshot | None = None) -> Snapshot:
    """The part of `snapshot` a node assigned `pools` may see: those pools' clusters (with
    canary and fallback clusters, and the pools they depend on), their CLAs, the listener,
    and a RouteConfiguration rebuilt for that sub-config. Cluster and CLA Resource objects
    are the snapshot's own (their encoded bytes are shared); the route is reused from
    `previous` when unchanged. Raises InconsistentSnapshotError (e.g. config and snapshot
    out of step)."""
    kept = pool_closure(config, pools)
    sub_config = config.model_copy(update={"pools": [p for p in config.pools if p.name in kept]})
    clusters = set().union(*(pool_clusters(p) for p in sub_config.pools))
    clusters |= request_features.extra_cluster_names(sub_config)
    resources: dict[str, Mapping[str, Resource]] = {}
    for type_url, items in snapshot.resources.items():
        if type_url in (type_urls.CLUSTER, type_urls.ENDPOINT):
            resources[type_url] = _only(items, clusters)
        elif type_url != type_urls.ROUTE:
            resources[type_url] = items
    route = make_resource(type_urls.ROUTE, build_route_config(sub_config, canary_percent))
    resources[type_urls.ROUTE] = MappingProxyType({route.name: route})
    problems = check_consistency(resources)
    missing = sorted(clusters - set(resources.get(type_urls.CLUSTER, {})))
    if missing:
        problems.append(f"clusters {missing} of pools {sorted(kept)} are not in the snapshot")
    if problems:
        raise InconsistentSnapshotError(problems)
    versions = {t: type_version(r) for t, r in sorted(resources.items())}
    overall = content_hash(*(f"{t}={v}".encode() for t, v in versions.items()))
    view = Snapshot(MappingProxyType(resources), MappingProxyType(versions), overall)
    return view.reusing(previous)


ConfigSource = Callable[[], tuple[Config, Mapping[str, float]]]


class SnapshotViews:
    """Filtered snapshots cached per (snapshot version, pool set): N streams of one node
    cluster share one view and its encoded bytes. An inconsistent view is refused and the
    last good view of that pool set is served (None before the first good one)."""

    def __init__(self, source: ConfigSource, max_entries: int = 64) -> None:
        self.source = source  # () -> (current config, canary percents), e.g. the controller's
        self.max_entries = max_entries
        self.built = 0
        self.refused = 0
        self._views: OrderedDict[tuple[str, frozenset[str]], Snapshot] = OrderedDict()
        self._last: dict[frozenset[str], Snapshot] = {}

    def get(self, snapshot: Snapshot, pools: frozenset[str]) -> Snapshot | None:
        key = (snapshot.version, pools)
        view = self._views.get(key)
        if view is not None:
            self._views.move_to_end(key)
            return view
        config, canary = self.source()
        try:
            view = filter_snapshot(snapshot, pools, config, canary, self._last.get(pools))
        except InconsistentSnapshotError as exc:
            self.refused += 1
            log.error("refusing the view for pools %s, keeping the last good one: %s",
                      sorted(pools), exc)
            return self._last.get(pools)
        self.built += 1
        self._views[key] = self._last[pools] = view
        while len(self._views) > self.max_entries:
            self._views.popitem(last=False)
        return view


# -- rate limiting and server options --------------------------------------------------------


@dataclass
class RateLimiter:
    """Token bucket per peer: `burst` requests at once, refilled at `rate_per_s`. Pure: the
    caller passes the time. Idle peers are forgotten once more than `max_peers` are known."""

    rate_per_s: float
    burst: float
    max_peers: int = 10_000
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0 or self.burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {self.rate_per_s}, "
                             f"{self.burst}")

    def allow(self, peer: str, now: float) -> bool:
        tokens, last = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - last) * self.rate_per_s)
        allowed = tokens >= 1
        self._buckets[peer] = (tokens - 1 if allowed else tokens, now)
        if len(self._buckets) > self.max_peers:
            self._forget_idle(now)
        return allowed

    def _forget_idle(self, now: float) -> None:
        """Drop peers whose bucket has refilled: forgetting them changes nothing."""
        self._buckets = {peer: (tokens, last) for peer, (tokens, last) in self._buckets.items()
                         if tokens + max(0.0, now - last) * self.rate_per_s < self.burst}

    def __len__(self) -> int:
        return len(self._buckets)


def server_options(max_concurrent_streams: int | None = 16,
                   max_receive_bytes: int | None = 16 * 1024 * 1024,
                   max_connection_age_s: float | None = None,
                   max_connection_age_grace_s: float | None = 30.0) -> list[tuple[str, int]]:
    """grpc server options for the xDS port.

    * ``grpc.max_concurrent_streams``: HTTP/2 streams per *connection* (an ADS Envoy uses 1,
      per-type xDS 4). Server-wide, pass ``maximum_concurrent_rpcs`` to ``grpc.aio.server``.
    * ``grpc.max_receive_message_length``: the largest request; larger ones fail with
      RESOURCE_EXHAUSTED. A NACK carries Envoy's error text, which may embed a resource.
    * ``grpc.max_connection_age_ms`` (+/-10 % jitter by gRPC) sends GOAWAY after that age;
      ``grpc.max_connection_age_grace_ms`` then closes the connection, ending the xDS
      stream: Envoy reconnects, through the load balancer, possibly to another replica. xDS
      streams never end on their own, so an age without a grace does nothing for them."""
    options: list[tuple[str, int]] = []
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", _positive(max_concurrent_streams,
                                                                 "max_concurrent_streams")))
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length",
                        _positive(max_receive_bytes, "max_receive_bytes")))
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms",
                        _positive(round(max_connection_age_s * 1000), "max_connection_age_s")))
        if max_connection_age_grace_s is not None:
            grace = round(max_connection_age_grace_s * 1000)
            if grace < 0:
                raise ValueError(f"max_connection_age_grace_s must be >= 0, got "
                                 f"{max_connection_age_grace_s}")
            options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


def _positive(value: int, name: str) -> int:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)


# -- the guard: what transport calls per stream ----------------------------------------------


class Denied(Exception):
    """End the stream: `code` (PERMISSION_DENIED or RESOURCE_EXHAUSTED) and `reason`."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def peer_host(peer: str) -> str:
    """``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``; ``ipv6:[::1]:5000`` -> ``[::1]``."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return rest.rpartition(":")[0]
    return peer


@dataclass
class StreamAccess:
    """One stream's security state, kept by the transport next to its StreamInfo."""

    peer: str
    identities: list[str]
    node: base_pb2.Node | None = None
    decision: Decision | None = None
    generation: int = -1  # the authorizer generation `decision` was made under

    @property
    def rate_key(self) -> str:
        """With a client certificate, rate limits apply per identity and host,
        ``<first SAN>@<IP>``: that client cannot reset its bucket by reconnecting. Without
        one, per connection (the peer with its port): a plaintext peer proves no identity,
        and one bucket per IP would make every Envoy behind a NAT or on one node share it."""
        if not self.identities:
            return self.peer
        return f"{self.identities[0]}@{peer_host(self.peer)}"


class XdsGuard:
    """Authorisation, rate limiting and per-node views for the xDS transport.

    Per stream: `open(context)` once; `on_request(access)` before each request is handled;
    `admit(access, machine.node)` after it; `view(access, cache.snapshot)` instead of the
    cache's snapshot. The last three raise Denied; the caller aborts with its code."""

    def __init__(self, authorizer: NodeAuthorizer | None = None,
                 limiter: RateLimiter | None = None, views: SnapshotViews | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.authorizer = authorizer or NodeAuthorizer()
        self.limiter = limiter
        self.views = views
        self.clock = clock
        self.generation = 0
        self.denied: Counter[str] = Counter()  # "permission" | "rate" -> streams ended

    def update(self, authorizer: NodeAuthorizer) -> None:
        """A reloaded `nodes:` section; open streams are re-checked on their next push."""
        self.authorizer = authorizer
        self.generation += 1

    def open(self, context: grpc.aio.ServicerContext) -> StreamAccess:
        return StreamAccess(context.peer(), peer_identities(context))

    def on_request(self, access: StreamAccess) -> None:
        if self.limiter is not None and not self.limiter.allow(access.rate_key, self.clock()):
            self.denied["rate"] += 1
            reason = (f"xDS request rate above {self.limiter.rate_per_s:g}/s "
                      f"(burst {self.limiter.burst:g}) for {access.rate_key}")
            log.warning("ending stream from %s: %s", access.peer, reason)
            raise Denied(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)

    def admit(self, access: StreamAccess, node: base_pb2.Node | None) -> Decision:
        """Decide once per stream (again after `update`). Raises Denied on a refusal."""
        if access.decision is not None and access.generation == self.generation:
            return access.decision
        access.node = node if node is not None else access.node
        decision = self.authorizer.authorize(access.node, access.identities)
        access.decision, access.generation = decision, self.generation
        if not decision.allowed:
            self.denied["permission"] += 1
            log.warning("denying xDS stream from %s (node %r): %s", access.peer,
                        getattr(access.node, "id", None), decision.reason)
            raise Denied(grpc.StatusCode.PERMISSION_DENIED, decision.reason)
        log.info("xDS stream from %s (node %r) allowed pools %s: %s", access.peer,
                 getattr(access.node, "id", None),
                 "all" if decision.pools is None else sorted(decision.pools), decision.reason)
        return decision

    def view(self, access: StreamAccess, snapshot: Snapshot | None) -> Snapshot | None:
        """What this stream may be sent: None until admitted, else its pools' view."""
        if snapshot is None or access.decision is None:
            return None
        decision = self.admit(access, access.node)
        if decision.pools is None or self.views is None:
            return snapshot
        return self.views.get(snapshot, decision.pools)


# -- admin API bearer token ------------------------------------------------------------------

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_token(token_file: str | None = None, token_env: str | None = None,
               environ: Mapping[str, str] | None = None) -> str | None:
    """The admin token from a file (first line) or an environment variable; None if neither
    is configured. Raises ValueError naming the file or variable when it is missing/empty."""
    if token_file is not None:
        try:
            text = Path(token_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"admin token file {token_file!r} cannot be read: "
                             f"{exc.strerror}") from None
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise ValueError(f"admin token file {token_file!r} is empty")
        return _ascii_token(token, f"admin token file {token_file!r}")
    if token_env is not None:
        token = (environ if environ is not None else os.environ).get(token_env, "").strip()
        if not token:
            raise ValueError(f"admin token variable {token_env} is unset or empty")
        return _ascii_token(token, f"admin token variable {token_env}")
    return None


def _ascii_token(token: str, where: str) -> str:
    """A bearer token is printable ASCII (RFC 6750 b64token): no client could send another."""
    if not (token.isascii() and token.isprintable()):
        raise ValueError(f"{where} holds characters a bearer token cannot carry (printable "
                         f"ASCII only)")
    return token


def _unauthorized(message: str) -> web.Response:
    body = {"error": {"status": 401, "message": message}}
    return web.json_response(body, status=401,
                             headers={"WWW-Authenticate": 'Bearer realm="trimtab"'})


def bearer_middleware(token: str | None, protect_reads: bool = False) -> Any:
    """aiohttp middleware: with a token, every non-GET/HEAD/OPTIONS request needs
    ``Authorization: Bearer <token>``, and reads too when `protect_reads`; /healthz and
    /readyz stay open. Comparison is constant-time. Without a token: a no-op."""
    expected = token.encode() if token else None

    @web.middleware
    async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is None or request.path in OPEN_PATHS:
            return await handler(request)
        if request.method in SAFE_METHODS and not protect_reads:
            return await handler(request)
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: a non-ASCII byte is a
        # lone surrogate that str.encode() refuses. A token is ASCII, so such a header is
        # simply a wrong token; only ASCII ever reaches the comparison.
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return _unauthorized("this endpoint needs 'Authorization: Bearer <token>'")
        if not given.isascii() or not hmac.compare_digest(given.encode("ascii"), expected):
            return _unauthorized("invalid bearer token")
        return await handler(request)

    return bearer
