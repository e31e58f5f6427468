"""The stream guard of the xDS port: what the transport calls per stream (`XdsGuard`). It
composes node authorisation (`authz`), the request rate limit (`limits`) and per-node views
of the snapshot (`envoy.views`); the peer's certificate identities come from `identity`.

Node authorisation, in one paragraph: a node's *cluster* (``node.cluster``) selects the pools it
may see (``nodes.clusters``; ``"*"`` is the default entry). With ``require_san_match`` the
client certificate (mTLS) must name that node: one of its SANs must match the node id or the
node cluster by the rules of `identity.san_binding`. A node that fails gets PERMISSION_DENIED.
An authorised node receives a *view* of the snapshot holding only its pools
(`views.filter_snapshot`), cached per (snapshot version, pool set) so every stream of that node
cluster shares one view and its encoded bytes. See docs/security.md.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from envoy.config.core.v3 import base_pb2

from xds_server.envoy.views import SnapshotViews
from xds_server.security.authz import Decision, NodeAuthorizer
from xds_server.security.identity import peer_identities
from xds_server.security.limits import RateLimiter
from xds_server.xds.snapshot import Snapshot

log = logging.getLogger("trimtab.security")


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
