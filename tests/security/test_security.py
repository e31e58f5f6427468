"""Security: TLS/mTLS on the xDS port with real grpcio clients and a real Envoy, node
authorisation, per-node snapshot views, the admin bearer token, and limits.

Certificates are made per test module with `cryptography` (tests/support/certs.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from envoy.config.cluster.v3.cluster_pb2 import Cluster
from envoy.config.core.v3.base_pb2 import Node
from envoy.config.route.v3.route_pb2 import RouteConfiguration
from envoy.service.discovery.v3.discovery_pb2 import DiscoveryRequest, DiscoveryResponse

from tests.support.certs import CertFiles, TestCA
from tests.support.hooks import HookedController
from tests.support.paths import EXAMPLES
from tests.support.pinned_rollouts import PinnedRollouts
from tests.support.wait import wait_until_async
from trimtab_dev.envoy_process import EnvoyProcess, free_port
from xds_server.config.checks import node_pool_problems
from xds_server.config.load import parse_config
from xds_server.config.schema import Config, ListenerConfig
from xds_server.control.controller import Controller
from xds_server.envoy.views import SnapshotViews, ViewInputs, filter_snapshot, pool_closure
from xds_server.security.admin_auth import bearer_middleware, load_token
from xds_server.security.authz import Decision, NodeAuthorizer
from xds_server.security.guard import Denied, StreamAccess, XdsGuard, peer_host
from xds_server.security.identity import dns_claim, peer_identities, san_binding
from xds_server.security.limits import RateLimiter, server_options
from xds_server.security.tls import TlsConfigError, server_credentials
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.protocol import DeltaStream, SotwStream
from xds_server.xds.server import XdsServicer, start_xds_server
from xds_server.xds.snapshot import Snapshot, build_snapshot, check_consistency
from xds_server.xds.stream_info import StreamInfo

ADS = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
EXAMPLE = EXAMPLES / "envoy-bootstrap-mtls.yaml"
EDGE_A_URI = "spiffe://trimtab/cluster/edge-a/node/envoy-1"


# -- certificates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: TestCA
    server: CertFiles
    edge_a: CertFiles  # envoy-1 in edge-a: URI and DNS SANs proving both
    ns_only: CertFiles  # envoy-1, URI SAN proving the node id only
    edge_b: CertFiles  # envoy-2 in edge-b
    cn_only: CertFiles  # no SANs, CN envoy-3
    rogue: CertFiles  # edge-a/envoy-1 SANs, but signed by another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca = TestCA.create(base / "ca")
    rogue_ca = TestCA.create(base / "rogue", "rogue CA")
    return Pki(
        ca=ca, server=ca.server(),
        edge_a=ca.issue("envoy-1", dns=["envoy-1.edge-a"], uris=[EDGE_A_URI]),
        ns_only=ca.issue("ns-envoy-1", uris=["spiffe://trimtab/ns/default/node/envoy-1"]),
        edge_b=ca.issue("envoy-2", uris=["spiffe://trimtab/cluster/edge-b/node/envoy-2"]),
        cn_only=ca.issue("cn-only", common_name="envoy-3"),
        rogue=rogue_ca.issue("rogue", uris=[EDGE_A_URI]),
    )


def mtls(pki: Pki) -> grpc.ServerCredentials:
    return server_credentials(str(pki.server.cert), str(pki.server.key), str(pki.ca.path), True)


def channel_creds(pki: Pki, client: CertFiles | None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(pki.ca.path.read_bytes())
    return grpc.ssl_channel_credentials(pki.ca.path.read_bytes(), client.key_pem, client.cert_pem)


# -- server_credentials: files ---------------------------------------------------------------


def test_credentials_name_the_missing_file(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TlsConfigError, match=r"certificate file '.*nope.pem' does not exist"):
        server_credentials(missing, str(pki.server.key))
    with pytest.raises(TlsConfigError, match=r"private key file '.*nope.pem' does not exist"):
        server_credentials(str(pki.server.cert), missing)
    with pytest.raises(TlsConfigError, match=r"client CA file '.*nope.pem' does not exist"):
        server_credentials(str(pki.server.cert), str(pki.server.key), missing, True)
    with pytest.raises(TlsConfigError, match="is a directory"):
        server_credentials(str(tmp_path), str(pki.server.key))


def test_credentials_report_unreadable_and_non_pem_files(pki: Pki, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsConfigError, match=r"certificate file '.*junk.pem' holds no PEM"):
        server_credentials(str(junk), str(pki.server.key))
    with pytest.raises(TlsConfigError, match=r"private key file '.*server.pem' holds no PEM PRIV"):
        server_credentials(str(pki.server.cert), str(pki.server.cert))
    real_read = Path.read_bytes

    def deny(path: Path) -> bytes:
        if path == pki.server.key:
            raise PermissionError(13, "Permission denied")
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(TlsConfigError, match=r"'.*server-key.pem' cannot be read: Permission"):
        server_credentials(str(pki.server.cert), str(pki.server.key))


def test_credentials_refuse_a_key_of_another_certificate(pki: Pki) -> None:
    with pytest.raises(TlsConfigError, match=r"private key file '.*envoy-2-key.pem' does not "
                                             r"match certificate file '.*server.pem'"):
        server_credentials(str(pki.server.cert), str(pki.edge_b.key))


def test_credentials_require_a_client_ca_for_mtls(pki: Pki, tmp_path: Path) -> None:
    for ca, require in ((None, True), (str(pki.ca.path), False)):
        with pytest.raises(TlsConfigError, match="require_client_cert and client_ca_file .* go together"):
            server_credentials(str(pki.server.cert), str(pki.server.key), ca, require)
    bad_ca = tmp_path / "bad-ca.pem"
    bad_ca.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    with pytest.raises(TlsConfigError, match=r"client CA file '.*bad-ca.pem' is invalid"):
        server_credentials(str(pki.server.cert), str(pki.server.key), str(bad_ca), True)


# -- TLS and mTLS with real grpcio clients ---------------------------------------------------


async def _who_am_i_server(creds: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return json.dumps(peer_identities(context)).encode()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Who", {"AmI": grpc.unary_unary_rpc_method_handler(who)}),))
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


async def _who_am_i(port: int, creds: grpc.ChannelCredentials) -> list[str]:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        return json.loads(await channel.unary_unary("/test.Who/AmI")(b"", timeout=5))


def test_tls_serves_clients_without_certificates(pki: Pki) -> None:
    async def body() -> None:
        creds = server_credentials(str(pki.server.cert), str(pki.server.key))
        server, port = await _who_am_i_server(creds)
        try:
            assert await _who_am_i(port, channel_creds(pki, None)) == []
            # Plain TLS never asks for a client certificate, so it yields no identity.
            assert await _who_am_i(port, channel_creds(pki, pki.edge_a)) == []
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await plain.unary_unary("/test.Who/AmI")(b"", timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    asyncio.run(body())


def test_mtls_refuses_clients_without_a_trusted_certificate(pki: Pki) -> None:
    async def body() -> None:
        server, port = await _who_am_i_server(mtls(pki))
        try:
            for client in (None, pki.rogue):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _who_am_i(port, channel_creds(pki, client))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await _who_am_i(port, channel_creds(pki, pki.edge_a)) == [
                EDGE_A_URI, "envoy-1.edge-a"]
        finally:
            await server.stop(None)
    asyncio.run(body())


def test_peer_identities_are_uri_then_dns_sans_else_the_common_name(pki: Pki) -> None:
    async def body() -> None:
        server, port = await _who_am_i_server(mtls(pki))
        try:
            assert await _who_am_i(port, channel_creds(pki, pki.cn_only)) == ["envoy-3"]
            assert await _who_am_i(port, channel_creds(pki, pki.ns_only)) == [
                "spiffe://trimtab/ns/default/node/envoy-1"]
        finally:
            await server.stop(None)
    asyncio.run(body())


def _install(files: dict[Path, Path]) -> None:
    """Swap files in atomically (a new inode, like a Kubernetes secret update)."""
    for src, dst in files.items():
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


def test_reloading_credentials_pick_up_a_rotated_certificate_and_ca(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old_ca, new_ca = TestCA.create(tmp_path / "old"), TestCA.create(tmp_path / "new", "new CA")
    old = (old_ca.server(), old_ca.issue("client", uris=["spiffe://t/node/old"]))
    new = (new_ca.server(), new_ca.issue("client", uris=["spiffe://t/node/new"]))
    live = {name: tmp_path / name for name in ("tls.crt", "tls.key", "ca.crt")}
    _install({old[0].cert: live["tls.crt"], old[0].key: live["tls.key"],
              old_ca.path: live["ca.crt"]})
    creds = server_credentials(str(live["tls.crt"]), str(live["tls.key"]), str(live["ca.crt"]),
                               True, reload=True)

    def client(ca: TestCA, cert: CertFiles) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(ca.path.read_bytes(), cert.key_pem, cert.cert_pem)

    async def body() -> None:
        server, port = await _who_am_i_server(creds)
        try:
            assert await _who_am_i(port, client(old_ca, old[1])) == ["spiffe://t/node/old"]
            _install({new[0].key: live["tls.key"]})  # half a rotation: the key does not match
            with caplog.at_level(logging.ERROR, "trimtab.security"):
                assert await _who_am_i(port, client(old_ca, old[1])) == ["spiffe://t/node/old"]
            assert "does not match certificate file" in caplog.text
            _install({new[0].cert: live["tls.crt"], new_ca.path: live["ca.crt"]})
            assert await _who_am_i(port, client(new_ca, new[1])) == ["spiffe://t/node/new"]
            with pytest.raises(grpc.aio.AioRpcError):
                await _who_am_i(port, client(old_ca, old[1]))
        finally:
            await server.stop(None)
    asyncio.run(body())


# -- SAN mapping and authorisation -----------------------------------------------------------


@pytest.mark.parametrize(("identity", "node_id", "cluster", "expected"), [
    ("spiffe://trimtab/cluster/edge-a/node/envoy-1", "envoy-1", "edge-a", "both"),
    ("spiffe://trimtab/cluster/edge-a/node/envoy-1", "envoy-1", "edge-b", None),
    ("spiffe://trimtab/cluster/edge-a/node/envoy-1", "envoy-2", "edge-a", None),
    ("spiffe://trimtab/cluster/edge-a", "anything", "edge-a", "cluster"),
    ("spiffe://trimtab/ns/default/node/envoy-1", "envoy-1", "edge-a", "node"),
    ("spiffe://trimtab/ns/default/sa/envoy-1", "envoy-1", "edge-a", "node"),
    ("spiffe://trimtab/ns/default/sa/envoy-1", "envoy-2", "edge-a", None),
    ("spiffe://trimtab/cluster/edge%2Da/node/envoy-1", "envoy-1", "edge-a", "both"),
    ("envoy-1.edge-a", "envoy-1", "edge-a", "both"),
    ("ENVOY-1.Edge-A.", "envoy-1", "edge-a", "both"),
    # every label after the first is the cluster: a suffix is not ignored (see dns_suffix)
    ("envoy-1.edge-a.svc.cluster.local", "envoy-1", "edge-a", None),
    ("envoy-1.edge-a.svc.cluster.local", "envoy-1", "edge-a.svc.cluster.local", "both"),
    # dotted cluster names, both ways: the SAN names exactly one (node, cluster)
    ("n1.prod.eu", "n1", "prod.eu", "both"),
    ("n1.prod.eu", "n1", "prod", None),
    ("n1.prod", "n1", "prod.eu", None),
    ("n1.prod.eu", "n1.prod", "eu", None),   # a dotted node id is never a DNS SAN's
    ("n1.prod", "n1.prod", "edge-a", None),
    ("n1..eu", "n1", ".eu", None),
    ("spiffe://trimtab/cluster/prod.eu/node/n1", "n1", "prod.eu", "both"),
    ("spiffe://trimtab/cluster/prod.eu/node/n1", "n1", "prod", None),
    ("spiffe://trimtab/cluster/prod/node/n1.eu", "n1.eu", "prod", "both"),  # URI: dotted ids
    ("spiffe://trimtab/cluster/prod/cluster/eu/node/n1", "n1", "prod", None),
    ("spiffe://trimtab/cluster/prod/node/n1/node/n2", "n1", "prod", None),
    ("envoy-1", "envoy-1", "edge-a", "node"),
    ("envoy-1.edge-b", "envoy-1", "edge-a", None),
    ("envoy-10", "envoy-1", "edge-a", None),
    ("*.edge-a", "envoy-1", "edge-a", None),
    ("envoy-1", "", "edge-a", None),
])
def test_san_binding(identity: str, node_id: str, cluster: str, expected: str | None) -> None:
    assert san_binding(identity, node_id, cluster) == expected


# Claims a hostile node might try with one certificate: dotted and undotted splits of it.
CLAIMS = [(n, c) for n in ("n1", "n1.prod", "n1.prod.eu", "prod", "")
          for c in ("", "eu", "prod", "prod.eu", "prod.eu.x", "n1.prod.eu")]


@pytest.mark.parametrize("san", ["n1.prod.eu", "n1.prod.eu.", "N1.Prod.EU", "n1.prod",
                                 "n1", "n1.prod.eu.x"])
def test_a_dns_san_proves_at_most_one_node_and_cluster(san: str) -> None:
    both = [claim for claim in CLAIMS if san_binding(san, *claim) == "both"]
    node_only = [claim for claim in CLAIMS if san_binding(san, *claim) == "node"]
    assert len(both) <= 1 and {n for n, _ in node_only} <= {"n1"}
    parsed = dns_claim(san)
    assert parsed is not None and parsed[0] == "n1"
    if parsed[1] is not None:
        assert both == [("n1", parsed[1])] and not node_only
    else:
        assert not both and node_only


def test_dns_suffix_is_removed_before_the_split() -> None:
    suffix = "svc.cluster.local"
    san = "envoy-1.edge-a.svc.cluster.local."
    assert dns_claim(san, suffix) == ("envoy-1", "edge-a")
    assert san_binding(san, "envoy-1", "edge-a", dns_suffix=suffix) == "both"
    assert san_binding("n1.prod.eu.svc.cluster.local", "n1", "prod", dns_suffix=suffix) is None
    assert san_binding("n1.prod.eu.svc.cluster.local", "n1", "prod.eu",
                       dns_suffix=suffix) == "both"
    assert san_binding("envoy-1.svc.cluster.local", "envoy-1", "x", dns_suffix=suffix) == "node"
    assert san_binding("envoy-1.edge-a", "envoy-1", "edge-a", dns_suffix=suffix) is None
    assert dns_claim("svc.cluster.local", suffix) is None


def test_a_certificate_for_a_dotted_cluster_cannot_claim_its_prefix() -> None:
    """Issue 12 §3: a certificate for node n1 of cluster prod.eu claimed cluster prod."""
    auth = NodeAuthorizer.from_mapping({"prod": ["llama3-8b"], "prod.eu": ["qwen-72b"]},
                                       require_san_match=True, require_cluster_binding=True)
    assert not auth.authorize(node("n1", "prod"), ["n1.prod.eu"]).allowed
    assert not auth.authorize(node("n1.prod", "eu"), ["n1.prod.eu"]).allowed
    own = auth.authorize(node("n1", "prod.eu"), ["n1.prod.eu"])
    assert own.allowed and own.pools == {"qwen-72b"}
    loose = NodeAuthorizer.from_mapping({"prod": ["llama3-8b"], "prod.eu": ["qwen-72b"]},
                                        require_san_match=True)
    assert not loose.authorize(node("n1", "prod"), ["n1.prod.eu"]).allowed


def test_san_binding_with_a_trust_domain() -> None:
    assert san_binding(EDGE_A_URI, "envoy-1", "edge-a", "trimtab") == "both"
    assert san_binding("spiffe://other/cluster/edge-a/node/envoy-1", "envoy-1", "edge-a",
                       "trimtab") is None
    assert san_binding("https://trimtab/cluster/edge-a/node/envoy-1", "envoy-1", "edge-a",
                       "trimtab") is None


NODES = {"edge-a": ["llama3-8b"], "edge-b": ["mistral-7b", "mistral-spill"], "ops": ["*"]}


def node(node_id: str, cluster: str) -> Node:
    return Node(id=node_id, cluster=cluster)


def test_authorize_maps_node_clusters_to_pools() -> None:
    auth = NodeAuthorizer.from_mapping(NODES)
    assert auth.authorize(node("e1", "edge-a"), []) == Decision(
        True, frozenset({"llama3-8b"}), "node cluster 'edge-a'")
    assert auth.authorize(node("o1", "ops"), []).pools is None  # "*": every pool
    unknown = auth.authorize(node("x", "lab"), [])
    assert not unknown.allowed and "'lab' is not in nodes.clusters" in unknown.reason
    fallback = NodeAuthorizer.from_mapping({**NODES, "*": ["qwen-72b"]})
    assert fallback.authorize(node("x", "lab"), []).pools == frozenset({"qwen-72b"})
    assert not auth.authorize(None, []).allowed
    assert NodeAuthorizer.from_config(None).authorize(node("x", "y"), []).pools is None


def test_authorize_with_san_match() -> None:
    auth = NodeAuthorizer.from_mapping(NODES, require_san_match=True)
    ok = auth.authorize(node("envoy-1", "edge-a"), ["envoy-1.edge-a"])
    assert ok.allowed and ok.identity == "envoy-1.edge-a" and ok.pools == {"llama3-8b"}
    impostor = auth.authorize(node("envoy-1", "edge-b"), [EDGE_A_URI, "envoy-1.edge-a"])
    assert not impostor.allowed and "match neither" in impostor.reason
    no_cert = auth.authorize(node("envoy-1", "edge-a"), [])
    assert not no_cert.allowed and "no client certificate" in no_cert.reason
    node_only = ["spiffe://trimtab/ns/default/node/envoy-1"]
    assert auth.authorize(node("envoy-1", "edge-b"), node_only).allowed  # proves the id only
    strict = NodeAuthorizer.from_mapping(NODES, require_san_match=True,
                                         require_cluster_binding=True)
    assert not strict.authorize(node("envoy-1", "edge-b"), node_only).allowed
    assert strict.authorize(node("envoy-1", "edge-a"), [EDGE_A_URI]).allowed


def test_authorizer_from_config_section() -> None:
    section = SimpleNamespace(clusters={"edge-a": ["llama3-8b"]}, require_san_match=True,
                              require_cluster_binding=True, trust_domain="trimtab",
                              dns_suffix="svc")
    auth = NodeAuthorizer.from_config(section)
    assert auth.trust_domain == "trimtab" and auth.require_cluster_binding
    assert auth.authorize(node("envoy-1", "edge-a"), ["envoy-1.edge-a.svc"]).allowed
    assert not auth.authorize(node("envoy-1", "edge-a"), ["envoy-1.edge-a"]).allowed
    assert auth.authorize(node("envoy-1", "edge-a"), [EDGE_A_URI]).allowed
    assert not auth.authorize(node("envoy-1", "edge-a"), ["spiffe://x/cluster/edge-a"]).allowed


# -- per-node views of the snapshot ----------------------------------------------------------


def _endpoints(*addresses: str) -> list[dict[str, str]]:
    return [{"address": address} for address in addresses]


CONFIG = parse_config({
    "listener": {"address": "127.0.0.1:10000"},
    "pools": [
        {"name": "llama3-8b", "model": "meta-llama/Llama-3.1-8B-Instruct",
         "versions": {"stable": {"endpoints": _endpoints("10.0.0.1:8000")},
                      "canary": {"endpoints": _endpoints("10.0.0.2:8000")}}},
        {"name": "mistral-7b", "model": "mistralai/Mistral-7B", "fallback": "mistral-spill",
         "endpoints": _endpoints("10.0.1.1:8000")},
        {"name": "mistral-spill", "model": "mistralai/Mistral-7B-spill",
         "endpoints": _endpoints("10.0.2.1:8000")},
        {"name": "qwen-72b", "model": "Qwen/Qwen2-72B", "endpoints": _endpoints("10.0.3.1:8000")},
    ],
})


class NoScraper:
    async def scrape(self, targets: dict[str, str], now: Callable[[], float]) -> dict:
        return {}

    async def close(self) -> None:
        pass


def published(config: Config = CONFIG, canary: dict[str, float] | None = None,
              controller_type: type[Controller] = Controller) -> tuple[Controller, SnapshotCache]:
    cache = SnapshotCache()
    controller = controller_type(config, cache, scraper=NoScraper(), clock=lambda: 1000.0,  # type: ignore[arg-type]
                                 rollouts=PinnedRollouts(config, canary))
    controller.ingest({})
    assert controller.reconcile()
    return controller, cache


def change_weights(controller: Controller) -> None:
    """Publish a new snapshot in which only llama3-8b's CLA changed."""
    controller.ingest({"10.0.0.1:8000": ScrapeResult({"gpu_mem_pct": 40.0}, None, 1000.0)})
    assert controller.publish()


def with_free_listener(config: Config) -> Config:
    return config.model_copy(update={"listener": ListenerConfig(
        address=f"127.0.0.1:{free_port()}")})


def route_clusters(snapshot: Snapshot) -> set[str]:
    (route,) = snapshot.of_type(T.ROUTE).values()
    message: RouteConfiguration = route.message  # type: ignore[assignment]
    names = set()
    for vhost in message.virtual_hosts:
        for r in vhost.routes:
            names.add(r.route.cluster)
            names.update(wc.name for wc in r.route.weighted_clusters.clusters)
    return names - {""}


def canary_splits(snapshot: Snapshot) -> set[tuple[str, int]]:
    (route,) = snapshot.of_type(T.ROUTE).values()
    message: RouteConfiguration = route.message  # type: ignore[assignment]
    return {(wc.name, wc.weight.value) for vhost in message.virtual_hosts
            for r in vhost.routes for wc in r.route.weighted_clusters.clusters}


def test_filter_snapshot_keeps_only_the_nodes_pools() -> None:
    controller, cache = published(canary={"llama3-8b": 25.0})
    full = cache.snapshot
    assert full is not None
    assert isinstance(full.source, ViewInputs)  # what the controller built it from
    view = filter_snapshot(full, frozenset({"llama3-8b"}), full.source)
    assert view.version == filter_snapshot(
        full, frozenset({"llama3-8b"}), ViewInputs(CONFIG, {"llama3-8b": 25.0})).version
    assert set(view.of_type(T.CLUSTER)) == {"llama3-8b", "llama3-8b-canary"}
    assert set(view.of_type(T.ENDPOINT)) == {"llama3-8b", "llama3-8b-canary"}
    assert route_clusters(view) == {"llama3-8b", "llama3-8b-canary"}
    route_text = str(next(iter(view.of_type(T.ROUTE).values())).message)
    assert "Qwen" not in route_text and "mistral" not in route_text
    assert canary_splits(view) == {("llama3-8b", 750), ("llama3-8b-canary", 250)}  # 25 %
    assert view.of_type(T.LISTENER) == full.of_type(T.LISTENER)
    assert check_consistency(view.resources) == []
    for type_url in (T.CLUSTER, T.ENDPOINT):  # the same Resource objects: bytes are shared
        assert all(res is full.of_type(type_url)[name]
                   for name, res in view.of_type(type_url).items())
    assert view.version != full.version and set(view.versions) == set(full.versions)


def test_filter_snapshot_follows_fallbacks() -> None:
    _, cache = published()
    assert cache.snapshot is not None
    view = filter_snapshot(cache.snapshot, frozenset({"mistral-7b"}), ViewInputs(CONFIG))
    assert set(view.of_type(T.CLUSTER)) == {"mistral-7b", "mistral-7b-with-fallback",
                                            "mistral-spill"}
    assert set(view.of_type(T.ENDPOINT)) == {"mistral-7b", "mistral-spill"}
    assert "mistral-7b-with-fallback" in route_clusters(view)
    assert check_consistency(view.resources) == []
    assert pool_closure(CONFIG, ["mistral-7b", "nope"]) == {"mistral-7b", "mistral-spill"}


def test_filter_snapshot_with_no_pools_is_consistent() -> None:
    _, cache = published()
    assert cache.snapshot is not None
    view = filter_snapshot(cache.snapshot, frozenset(), ViewInputs(CONFIG))
    assert not view.of_type(T.CLUSTER) and not view.of_type(T.ENDPOINT)
    assert route_clusters(view) == set() and check_consistency(view.resources) == []


def test_the_view_of_every_pool_is_the_published_snapshot() -> None:
    """Routes and clusters of a view come from the inputs the snapshot was published with: a
    node given every pool gets exactly what the controller published, byte for byte."""
    _, cache = published(canary={"llama3-8b": 25.0})
    full = cache.snapshot
    assert full is not None and isinstance(full.source, ViewInputs)
    view = filter_snapshot(full, frozenset(p.name for p in CONFIG.pools), full.source)
    assert view.version == full.version and dict(view.versions) == dict(full.versions)


def test_node_pool_problems() -> None:
    problems = node_pool_problems({"edge-a": ["llama3-8b", "gpt-5"],
                                   "edge-b": ["mistral-7b"], "ops": ["*"]}, CONFIG)
    assert problems == [
        ("nodes.clusters.edge-a[1]", "unknown pool 'gpt-5'"),
        ("nodes.clusters.edge-b", "pool 'mistral-7b' sends traffic to pool 'mistral-spill' "
                                  "(fallback or size class); assign 'mistral-spill' too"),
    ]
    assert node_pool_problems(NODES, CONFIG) == []
    assert node_pool_problems({"prod": ["*"], "PROD": ["*"]}, CONFIG) == [
        ("nodes.clusters.PROD", "differs from node cluster 'prod' only in case: one DNS SAN "
                                "would prove both")]


def test_views_are_shared_per_version_and_pool_set() -> None:
    controller, cache = published()
    views = SnapshotViews()
    edge_a, edge_b = frozenset({"llama3-8b"}), frozenset({"mistral-7b", "mistral-spill"})
    first = views.get(cache.snapshot, edge_a)  # type: ignore[arg-type]
    assert views.get(cache.snapshot, edge_a) is first  # type: ignore[arg-type]
    assert views.get(cache.snapshot, edge_b) is not first  # type: ignore[arg-type]
    assert views.built == 2
    change_weights(controller)
    second = views.get(cache.snapshot, edge_a)  # type: ignore[arg-type]
    assert second is not first and views.built == 3
    (old_route,), (new_route,) = first.of_type(T.ROUTE).values(), second.of_type(T.ROUTE).values()
    assert new_route is old_route  # unchanged route: the same object, encoded once
    assert views.routes_built == 2  # a weight-only snapshot builds no route


def test_a_view_route_is_rebuilt_when_the_canary_percent_changes() -> None:
    controller, cache = published()
    views = SnapshotViews()
    llama = frozenset({"llama3-8b"})
    before = views.get(cache.snapshot, llama)  # type: ignore[arg-type]
    assert before is not None and canary_splits(before) == set()
    controller.rollouts.pinned = {"llama3-8b": 40.0}  # type: ignore[attr-defined]
    assert controller.reconcile()
    after = views.get(cache.snapshot, llama)  # type: ignore[arg-type]
    assert after is not None and views.routes_built == 2
    assert canary_splits(after) == {("llama3-8b", 600), ("llama3-8b-canary", 400)}


def _qwen_falls_back_to_llama() -> Config:
    return CONFIG.model_copy(update={"pools": [
        p.model_copy(update={"fallback": "llama3-8b"}) if p.name == "qwen-72b" else p
        for p in CONFIG.pools]})


def test_views_follow_the_published_snapshot_not_a_config_whose_snapshot_was_refused() -> None:
    """A reload whose snapshot is refused leaves the controller's config ahead of the cache:
    views are built from what the cached snapshot was published with, so nodes keep getting
    a consistent view of it (read from the live config, this view was refused, and a pool
    set without an earlier view got nothing)."""
    controller, cache = published(controller_type=HookedController)
    assert isinstance(controller, HookedController)
    views = SnapshotViews()
    controller.mutators.append(lambda messages: messages[T.ROUTE].clear())  # refused: no RDS
    controller.apply_config(_qwen_falls_back_to_llama())
    assert not controller.publish() and controller.stats.rejected == 1
    view = views.get(cache.snapshot, frozenset({"qwen-72b"}))  # type: ignore[arg-type]
    assert view is not None and set(view.of_type(T.CLUSTER)) == {"qwen-72b"}
    assert views.refused == 0


def test_views_keep_the_last_good_view_when_inputs_and_snapshot_disagree(
        caplog: pytest.LogCaptureFixture) -> None:
    controller, cache = published()
    views = SnapshotViews()
    qwen = frozenset({"qwen-72b"})
    good = views.get(cache.snapshot, qwen)  # type: ignore[arg-type]
    assert good is not None
    change_weights(controller)
    # Published without its inputs, or with inputs it was not built from (qwen-72b falling
    # back to llama3-8b: the snapshot has no qwen-72b-with-fallback): never filtered wrongly.
    bare = build_snapshot(controller.resources())
    wrong = build_snapshot(controller.resources(), source=ViewInputs(_qwen_falls_back_to_llama()))
    with caplog.at_level(logging.ERROR, "trimtab.views"):
        assert views.get(bare, qwen) is good
        assert views.get(wrong, qwen) is good
    assert views.refused == 2 and "published without" in caplog.text
    assert "qwen-72b-with-fallback" in caplog.text
    fresh = views.get(cache.snapshot, qwen)  # type: ignore[arg-type]
    assert fresh is not None and fresh is not good and views.refused == 2


# -- the guard in a real xDS server ----------------------------------------------------------


class GuardedServicer(XdsServicer):
    """XdsServicer with XdsGuard wired the way docs/security.md asks transport.py to."""

    def __init__(self, cache: SnapshotCache, guard: XdsGuard) -> None:
        super().__init__(cache)
        self.guard = guard
        self.access: dict[StreamInfo, Any] = {}

    def _handler(self, api: str, service: str, type_url: str | None) -> Callable:
        async def handle(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> None:
            machine = SotwStream(type_url) if api == "sotw" else DeltaStream(type_url)
            info = StreamInfo(context.peer(), api, service.rsplit(".", 1)[-1], machine)
            self.access[info] = self.guard.open(context)
            try:
                await self._serve(info, requests, context)
            except Denied as exc:
                await context.abort(exc.code, exc.reason)
            finally:
                self.access.pop(info, None)
        return handle

    def _receive(self, info: StreamInfo, request: object) -> None:
        self.guard.on_request(self.access[info])
        super()._receive(info, request)
        self.guard.admit(self.access[info], info.machine.node)

    async def _pump(self, info: StreamInfo, inbox: Any, wake: asyncio.Event,
                    reader: asyncio.Task, context: grpc.aio.ServicerContext) -> None:
        access = self.access[info]
        while True:
            await wake.wait()
            wake.clear()
            while inbox:
                request = inbox.popleft()
                if request is None:
                    return
                self._receive(info, request)
            for response in info.machine.responses(self.guard.view(access, self.cache.snapshot)):
                await self._send(info, response, context)


def make_guard(controller: Controller, limiter: RateLimiter | None = None,
               **policy: Any) -> XdsGuard:
    views = SnapshotViews()
    return XdsGuard(NodeAuthorizer.from_mapping(NODES, **policy), limiter, views)


async def _guarded_server(pki: Pki, guard: XdsGuard, cache: SnapshotCache,
                          options: list[tuple[str, Any]] | None = None
                          ) -> tuple[grpc.aio.Server, int]:
    return await start_xds_server(GuardedServicer(cache, guard), "127.0.0.1:0",
                                  credentials=mtls(pki), options=options)


async def _first_cds(port: int, creds: grpc.ChannelCredentials, who: Node,
                     ) -> DiscoveryResponse:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        call = channel.stream_stream(ADS, request_serializer=DiscoveryRequest.SerializeToString,
                                     response_deserializer=DiscoveryResponse.FromString)()
        await call.write(DiscoveryRequest(node=who, type_url=T.CLUSTER))
        try:
            return await asyncio.wait_for(call.read(), 5)
        finally:
            call.cancel()


def test_guarded_stream_gets_only_its_pools_and_impostors_are_denied(pki: Pki) -> None:
    controller, cache = published()
    guard = make_guard(controller, require_san_match=True)

    async def body() -> None:
        server, port = await _guarded_server(pki, guard, cache)
        try:
            ok = await _first_cds(port, channel_creds(pki, pki.edge_a), node("envoy-1", "edge-a"))
            names = sorted(Cluster.FromString(any_.value).name for any_ in ok.resources)
            assert names == ["llama3-8b", "llama3-8b-canary"]
            for creds, who in ((pki.edge_b, node("envoy-1", "edge-a")),   # another node's cert
                               (pki.edge_a, node("envoy-1", "edge-b"))):  # claims another cluster
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _first_cds(port, channel_creds(pki, creds), who)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "match neither" in (err.value.details() or "")
        finally:
            await server.stop(None)
    asyncio.run(body())
    assert guard.denied["permission"] == 2


def test_dotted_cluster_certificate_over_mtls_gets_only_its_own_clusters_pools(pki: Pki
                                                                             ) -> None:
    """Issue 12 §3 over a real mTLS handshake: DNS SAN n1.prod.eu (node n1, cluster prod.eu)
    claiming cluster prod was given prod's pools."""
    controller, cache = published()
    cert = pki.ca.issue("n1-prod-eu", dns=["n1.prod.eu"])
    views = SnapshotViews()
    auth = NodeAuthorizer.from_mapping({"prod": ["llama3-8b"], "prod.eu": ["qwen-72b"]},
                                       require_san_match=True, require_cluster_binding=True)
    guard = XdsGuard(auth, None, views)

    async def body() -> None:
        server, port = await _guarded_server(pki, guard, cache)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _first_cds(port, channel_creds(pki, cert), node("n1", "prod"))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            own = await _first_cds(port, channel_creds(pki, cert), node("n1", "prod.eu"))
            assert sorted(Cluster.FromString(a.value).name for a in own.resources) == [
                "qwen-72b"]
        finally:
            await server.stop(None)
    asyncio.run(body())
    assert guard.denied["permission"] == 1


async def _final_status(call: Any) -> grpc.StatusCode:
    """Read what the server sent (grpc.aio reports the status only after that), then the
    status."""
    try:
        while await asyncio.wait_for(call.read(), 5) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError:
        pass
    return await asyncio.wait_for(call.code(), 5)


def test_guard_ends_a_stream_that_exceeds_its_request_rate(pki: Pki) -> None:
    controller, cache = published()
    clock = [0.0]
    guard = make_guard(controller, RateLimiter(rate_per_s=1, burst=2))
    guard.clock = lambda: clock[0]

    async def body() -> None:
        server, port = await _guarded_server(pki, guard, cache)
        try:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}",
                                               channel_creds(pki, pki.edge_a)) as channel:
                call = channel.stream_stream(
                    ADS, request_serializer=DiscoveryRequest.SerializeToString,
                    response_deserializer=DiscoveryResponse.FromString)()
                for type_url in (T.CLUSTER, T.LISTENER, T.ROUTE):
                    await call.write(DiscoveryRequest(node=node("envoy-1", "edge-a"),
                                                      type_url=type_url))
                assert await _final_status(call) == grpc.StatusCode.RESOURCE_EXHAUSTED
                details = await call.details() or ""
                assert details.endswith(f"request rate above 1/s (burst 2) for {EDGE_A_URI}@127.0.0.1")
        finally:
            await server.stop(None)
    asyncio.run(body())
    assert guard.denied["rate"] == 1


def _own_connection(port: int, creds: grpc.ChannelCredentials) -> grpc.aio.Channel:
    """A channel with its own TCP connection (grpcio shares subchannels across channels)."""
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                   options=[("grpc.use_local_subchannel_pool", 1)])


async def _ads_call(channel: grpc.aio.Channel) -> Any:
    return channel.stream_stream(ADS, request_serializer=DiscoveryRequest.SerializeToString,
                                 response_deserializer=DiscoveryResponse.FromString)()


def test_connections_from_one_host_and_identity_share_a_rate_bucket(pki: Pki) -> None:
    """Reconnecting (a new port) does not reset the bucket: the key is <SAN>@<IP>."""
    controller, cache = published()
    guard = make_guard(controller, RateLimiter(rate_per_s=1, burst=3))
    guard.clock = lambda: 0.0  # no refill
    who = node("envoy-1", "edge-a")

    async def body() -> None:
        servicer = GuardedServicer(cache, guard)
        server, port = await start_xds_server(servicer, "127.0.0.1:0", credentials=mtls(pki))
        creds = channel_creds(pki, pki.edge_a)
        try:
            async with _own_connection(port, creds) as first, \
                    _own_connection(port, creds) as second:
                one, two = await _ads_call(first), await _ads_call(second)
                await one.write(DiscoveryRequest(node=who, type_url=T.CLUSTER))
                await asyncio.wait_for(one.read(), 5)
                await one.write(DiscoveryRequest(type_url=T.LISTENER))
                await asyncio.wait_for(one.read(), 5)  # 2 of the 3 tokens used
                await two.write(DiscoveryRequest(node=who, type_url=T.CLUSTER))
                await asyncio.wait_for(two.read(), 5)
                peers = {info.peer for info in servicer.streams}
                assert len(peers) == 2 and {peer_host(p) for p in peers} == {"127.0.0.1"}
                await two.write(DiscoveryRequest(type_url=T.LISTENER))  # the 4th: over
                assert await _final_status(two) == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert (await two.details() or "").endswith(f"for {EDGE_A_URI}@127.0.0.1")
                one.cancel()
        finally:
            await server.stop(None)
    asyncio.run(body())
    assert guard.denied["rate"] == 1


def test_guard_rechecks_open_streams_after_a_reload() -> None:
    controller, cache = published()
    guard = make_guard(controller)
    access = StreamAccess("ipv4:127.0.0.1:1", [])
    assert guard.view(access, cache.snapshot) is None  # not admitted yet: nothing to send
    guard.admit(access, node("envoy-1", "edge-a"))
    view = guard.view(access, cache.snapshot)
    assert view is not None and set(view.of_type(T.CLUSTER)) == {"llama3-8b", "llama3-8b-canary"}
    guard.update(NodeAuthorizer.from_mapping({"edge-b": ["qwen-72b"]}))
    with pytest.raises(Denied) as denied:
        guard.view(access, cache.snapshot)
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_server_options_limit_request_size(pki: Pki) -> None:
    assert server_options(8, 1024, 600, 30) == [
        ("grpc.max_concurrent_streams", 8), ("grpc.max_receive_message_length", 1024),
        ("grpc.max_connection_age_ms", 600_000), ("grpc.max_connection_age_grace_ms", 30_000)]
    assert server_options(None, None, None, 30) == []
    with pytest.raises(ValueError, match="max_concurrent_streams must be > 0"):
        server_options(0, 1024, None, None)
    controller, cache = published()

    async def body() -> None:
        # start_xds_server puts caller options first; gRPC takes the first of a repeated key.
        server, port = await _guarded_server(pki, make_guard(controller), cache,
                                             server_options(4, 1024, 60, 5))
        try:
            big = Node(id="envoy-1", cluster="edge-a", user_agent_name="x" * 4096)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _first_cds(port, channel_creds(pki, pki.edge_a), big)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            ok = await _first_cds(port, channel_creds(pki, pki.edge_a), node("envoy-1", "edge-a"))
            assert len(ok.resources) == 2
        finally:
            await server.stop(None)
    asyncio.run(body())


async def _plain_server(cache: SnapshotCache, **kwargs: Any) -> tuple[grpc.aio.Server, int]:
    return await start_xds_server(XdsServicer(cache), "127.0.0.1:0", **kwargs)


async def _open_cds(channel: grpc.aio.Channel) -> tuple[Any, DiscoveryResponse]:
    """An ADS stream that has got its first CDS response (so the server counts it)."""
    call = await _ads_call(channel)
    await call.write(DiscoveryRequest(node=node("envoy-1", "edge-a"), type_url=T.CLUSTER))
    return call, await asyncio.wait_for(call.read(), 5)


def test_max_streams_refuses_one_stream_over_the_server_wide_limit() -> None:
    _, cache = published()

    async def body() -> None:
        server, port = await _plain_server(cache, maximum_concurrent_rpcs=2)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                open_calls = [(await _open_cds(channel))[0] for _ in range(2)]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _open_cds(channel)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                open_calls.pop().cancel()  # a slot frees up once a stream ends
                for _ in range(50):
                    try:
                        open_calls.append((await _open_cds(channel))[0])
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.05)
                assert len(open_calls) == 2
                for call in open_calls:
                    call.cancel()
        finally:
            await server.stop(None)
    asyncio.run(body())


def test_max_connection_age_ends_the_stream_and_the_client_reconnects() -> None:
    _, cache = published()

    async def body() -> None:
        servicer = XdsServicer(cache)
        options = server_options(16, None, max_connection_age_s=1.0, max_connection_age_grace_s=0.2)
        server, port = await start_xds_server(servicer, "127.0.0.1:0", options=options)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                started = asyncio.get_running_loop().time()
                call, first = await _open_cds(channel)
                [first_peer] = [info.peer for info in servicer.streams]
                assert await _final_status(call) == grpc.StatusCode.UNAVAILABLE
                elapsed = asyncio.get_running_loop().time() - started
                assert 0.85 <= elapsed < 4.0, elapsed  # 1 s (+/-10 %) + 0.2 s grace
                assert "max connection age" in (await call.details() or "")
                again, response = await _open_cds(channel)  # a new connection
                assert response.resources == first.resources
                assert [info.peer for info in servicer.streams] != [first_peer]
                again.cancel()
        finally:
            await server.stop(None)
    asyncio.run(body())


# -- rate limiter ----------------------------------------------------------------------------


def test_rate_limiter_token_bucket_with_a_fake_clock() -> None:
    limiter = RateLimiter(rate_per_s=2, burst=3)
    assert [limiter.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", 0.0)  # per peer
    assert not limiter.allow("a", 0.4)  # 0.8 token
    assert limiter.allow("a", 0.5) and not limiter.allow("a", 0.5)
    assert [limiter.allow("a", 100.0) for _ in range(4)] == [True, True, True, False]  # capped
    assert limiter.allow("c", 50.0) and not limiter.allow("a", 99.0)  # clock going back: no refill
    with pytest.raises(ValueError):
        RateLimiter(rate_per_s=0, burst=1)


def test_rate_limiter_forgets_idle_peers() -> None:
    limiter = RateLimiter(rate_per_s=1, burst=2, max_peers=3)
    limiter.allow("idle", 0.0)  # 1 token left; full again at t=1
    assert limiter.allow("busy", 1.0) and limiter.allow("busy", 1.0)  # empty at t=1
    limiter.allow("other", 1.2)
    assert len(limiter) == 3
    limiter.allow("new", 1.5)  # a 4th peer: the full buckets ("idle") are dropped
    assert len(limiter) == 3
    assert not limiter.allow("busy", 1.5)  # "busy" kept its (half-empty) bucket


def test_rate_key_is_the_identity_and_host_or_else_the_connection() -> None:
    assert StreamAccess("ipv4:10.0.0.1:5000", []).rate_key == "ipv4:10.0.0.1:5000"
    assert StreamAccess("ipv4:10.0.0.1:5001", []).rate_key != \
        StreamAccess("ipv4:10.0.0.1:5000", []).rate_key
    assert StreamAccess("ipv4:10.0.0.1:5001", ["spiffe://a", "b"]).rate_key == "spiffe://a@10.0.0.1"
    assert StreamAccess("ipv6:[::1]:7", ["b"]).rate_key == "b@[::1]"


def test_peer_host() -> None:
    assert peer_host("ipv4:10.0.0.1:5000") == "10.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "[::1]"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"


# -- admin bearer token ----------------------------------------------------------------------


def _admin_app(token: str | None, protect_reads: bool) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    app = web.Application(middlewares=[bearer_middleware(token, protect_reads)])
    for path in ("/healthz", "/readyz", "/metrics", "/v1/weights"):
        app.router.add_get(path, ok)
    app.router.add_post("/v1/rollouts/{pool}/{action}", ok)
    app.router.add_delete("/v1/thing", ok)
    return app


async def _statuses(app: web.Application,
                    requests: list[tuple[str, str, dict[str, str]]]) -> list[int]:
    async with TestClient(TestServer(app)) as client:
        out = []
        for method, path, headers in requests:
            response = await client.request(method, path, headers=headers)
            if response.status == 401:
                body = await response.json()
                assert body["error"]["status"] == 401
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
            out.append(response.status)
        return out


GOOD = {"Authorization": "Bearer s3cret"}


def test_bearer_token_guards_mutations_always() -> None:
    requests = [("POST", "/v1/rollouts/p/pause", {}), ("DELETE", "/v1/thing", {}),
                ("POST", "/v1/rollouts/p/pause", {"Authorization": "Bearer wrong"}),
                ("POST", "/v1/rollouts/p/pause", {"Authorization": "Basic czNjcmV0"}),
                ("POST", "/v1/rollouts/p/pause", GOOD), ("DELETE", "/v1/thing", GOOD),
                ("GET", "/v1/weights", {}), ("GET", "/healthz", {})]
    statuses = asyncio.run(_statuses(_admin_app("s3cret", False), requests))
    assert statuses == [401, 401, 401, 401, 200, 200, 200, 200]


def test_bearer_token_guards_reads_when_asked() -> None:
    requests = [("GET", "/v1/weights", {}), ("GET", "/metrics", {}), ("GET", "/v1/weights", GOOD),
                ("GET", "/healthz", {}), ("GET", "/readyz", {}), ("GET", "/nope", {})]
    statuses = asyncio.run(_statuses(_admin_app("s3cret", True), requests))
    assert statuses == [401, 401, 200, 200, 200, 401]


def test_no_token_means_no_checks() -> None:
    requests = [("POST", "/v1/rollouts/p/pause", {}), ("GET", "/v1/weights", {})]
    assert asyncio.run(_statuses(_admin_app(None, True), requests)) == [200, 200]


def test_load_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("  s3cret \nignored\n")
    assert load_token(str(path)) == "s3cret"
    assert load_token(None, "TOKEN", {"TOKEN": "abc"}) == "abc"
    assert load_token() is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(str(path))
    with pytest.raises(ValueError, match="cannot be read"):
        load_token(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="TOKEN is unset"):
        load_token(None, "TOKEN", {})


def test_load_token_refuses_a_token_no_client_could_send(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cr\u00e9t\n", encoding="utf-8")
    with pytest.raises(ValueError, match="printable ASCII only"):
        load_token(str(path))
    with pytest.raises(ValueError, match="TOKEN holds characters"):
        load_token(None, "TOKEN", {"TOKEN": "a\x07b"})


# -- a real Envoy over mTLS ------------------------------------------------------------------


def envoy_bootstrap(pki: Pki, client: CertFiles, who: Node, xds_port: int,
                    admin_port: int) -> dict[str, Any]:
    """examples/envoy-bootstrap-mtls.yaml pointed at this test's certificates and ports."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["node"] = {"id": who.id, "cluster": who.cluster}
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    (xds,) = config["static_resources"]["clusters"]
    xds["type"] = "STATIC"
    endpoint = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": xds_port}
    tls = xds["transport_socket"]["typed_config"]
    tls["sni"] = "localhost"
    common = tls["common_tls_context"]
    common["tls_certificates"] = [{"certificate_chain": {"filename": str(client.cert)},
                                   "private_key": {"filename": str(client.key)}}]
    common["validation_context"]["trusted_ca"] = {"filename": str(pki.ca.path)}
    common["validation_context"]["match_typed_subject_alt_names"][0]["matcher"] = {
        "exact": "localhost"}
    return config


async def _with_envoy(pki: Pki, client: CertFiles, who: Node, guard: XdsGuard,
                      cache: SnapshotCache, check: Callable[[EnvoyProcess], Awaitable[None]]
                      ) -> None:
    server, port = await _guarded_server(pki, guard, cache)
    envoy = EnvoyProcess()
    try:
        await asyncio.to_thread(envoy.start, envoy_bootstrap(pki, client, who, port, free_port()))
        await check(envoy)
    finally:
        await asyncio.to_thread(envoy.stop)
        await server.stop(None)


def _dynamic_clusters(envoy: EnvoyProcess) -> list[str]:
    names = [s["name"] for s in envoy.clusters_json().get("cluster_statuses", [])]
    return sorted(name for name in names if name != "xds_cluster")


@pytest.mark.slow
def test_real_envoy_gets_its_pools_over_mtls(pki: Pki) -> None:
    controller, cache = published(with_free_listener(CONFIG))
    guard = make_guard(controller, require_san_match=True, require_cluster_binding=True)

    async def check(envoy: EnvoyProcess) -> None:
        await asyncio.to_thread(envoy.wait_ready, 15)
        assert (envoy.stat("cluster.xds_cluster.ssl.handshake") or 0) > 0
        assert _dynamic_clusters(envoy) == ["llama3-8b", "llama3-8b-canary"]
        assert (envoy.stat("listener_manager.lds.update_success") or 0) >= 1

    asyncio.run(_with_envoy(pki, pki.edge_a, node("envoy-1", "edge-a"), guard, cache, check))
    assert guard.denied["permission"] == 0


@pytest.mark.slow
def test_real_envoy_claiming_another_cluster_is_denied(pki: Pki) -> None:
    controller, cache = published(with_free_listener(CONFIG))
    guard = make_guard(controller, require_san_match=True)

    async def check(envoy: EnvoyProcess) -> None:
        await asyncio.to_thread(envoy.wait_admin, 15)
        await wait_until_async(lambda: guard.denied["permission"] >= 1, 15.0,
                               "the guard to deny the stream", every=0.05)
        assert (envoy.stat("cluster.xds_cluster.ssl.handshake") or 0) > 0
        assert _dynamic_clusters(envoy) == []
        assert not envoy.stat("cluster_manager.cds.update_success")

    # A valid certificate for envoy-2 in edge-b, presented by a node claiming edge-a.
    asyncio.run(_with_envoy(pki, pki.edge_b, node("envoy-2", "edge-a"), guard, cache, check))
