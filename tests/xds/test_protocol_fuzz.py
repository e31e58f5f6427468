"""Property tests: random request sequences against the stream machines.

Invariants: no crash (only ProtocolError, and only for a request that breaks the protocol or
a bound: no type_url, a peer string over its bound, the subscription budget), state stays
bounded (what the machine keeps of node ids, names and NACK details within their bounds,
whatever the peer sent: long strings, control characters), a
version a client NACKed is never sent to it again, and the shortcuts (skipping a type whose
snapshot version is unchanged, looking only at the names a published snapshot changed) answer
exactly what a full evaluation of every type would. `FUZZ_EXAMPLES` raises the case count for
the long benchmark run (benchmarks/fuzz.sh); CI runs a short pass.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
from envoy.service.discovery.v3.discovery_pb2 import DeltaDiscoveryRequest, DiscoveryRequest
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from tests.support.xds_fixtures import snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.machine.base import names_size
from xds_server.xds.machine.limits import FieldLimits
from xds_server.xds.protocol import (
    RESPONSE_HEADROOM,
    DeltaStream,
    Nack,
    ProtocolError,
    ResourceLimitExceeded,
    Response,
    SotwStream,
    StreamLimits,
)
from xds_server.xds.server import encode_delta, encode_sotw

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
TYPES = [T.CLUSTER, T.ENDPOINT, T.LISTENER, T.ROUTE, ""]
NAMES = ["a", "b", "c", "routes", "*", "zz"]
# Small bounds, so that fuzzed peer strings cross them often; the snapshots' names fit.
FIELDS = FieldLimits(node_id=16, node_cluster=16, resource_name=16, type_url=80,
                     version_info=32, response_nonce=8, error_detail=128)
BUDGET = 48  # subscription bytes per stream
peer_text = st.text(max_size=24)  # any code point: control characters, line breaks, non-BMP
# Mostly well-formed, so that most sequences run long enough to exercise NACKs and parts.
name = st.one_of(*[st.sampled_from(NAMES)] * 4, peer_text)

weights = st.fixed_dictionaries({
    "a": st.fixed_dictionaries({"10.0.0.1:80": st.integers(0, 3)}),
    "b": st.fixed_dictionaries({"10.0.1.1:80": st.integers(1, 3)}),
}, optional={"c": st.fixed_dictionaries({"10.0.2.1:80": st.integers(1, 2)})})

# An op is one of: a new snapshot (published like the cache does, recording what changed, or
# not), a reply to the latest response, or a random request.
reply = st.tuples(st.just("reply"), st.sampled_from(TYPES[:4]), st.booleans(),
                  st.lists(st.sampled_from(NAMES), max_size=3))
garbage = st.tuples(st.just("request"), st.sampled_from(TYPES),
                    st.sampled_from(["", "1", "2", "5", "999", "x", "123456789"]),
                    st.lists(name, max_size=4), st.booleans(),
                    st.one_of(st.sampled_from(["", "v", "0123456789abcdef"]), st.text(max_size=40)),
                    st.one_of(st.none(), st.none(), peer_text),  # the node id
                    st.text(max_size=300),  # the NACK's error detail
                    st.dictionaries(name, st.text(max_size=40), max_size=3))  # Delta: held
ops = st.lists(st.one_of(st.tuples(st.just("snapshot"), weights, st.booleans()), reply, garbage),
               max_size=40)


def _key(response: Response) -> tuple:
    return (response.type_url, response.version, response.nonce,
            [(res.name, res.version) for res in response.resources], response.removed)


class Checker:
    """Drives one machine and checks every response against the NACK history."""

    def __init__(self, machine: SotwStream | DeltaStream, delta: bool) -> None:
        self.machine, self.delta = machine, delta
        self.ended = False  # a ProtocolError ends the stream: nothing more reaches the machine
        self.held: set[str] = set()  # names the client said it holds (Delta)
        self.snapshot = snapshot({"a": {"10.0.0.1:80": 1}, "b": {"10.0.1.1:80": 1}})
        self.last: dict[str, Response] = {}
        self.rejected: set[tuple[str, str, str]] = set()
        self.rejected_states: set[tuple[str, str]] = set()

    def request(self, type_url: str, nonce: str, names: list[str], error: bool, version: str,
                node: str | None = None, detail: str = "rejected",
                held: dict[str, str] | None = None):
        if self.ended:
            return
        if self.delta:
            req = DeltaDiscoveryRequest(type_url=type_url, response_nonce=nonce,
                                        resource_names_subscribe=names,
                                        initial_resource_versions=held or {})
        else:
            req = DiscoveryRequest(type_url=type_url, response_nonce=nonce,
                                   resource_names=names, version_info=version)
        if error:
            req.error_detail.message = detail
        if node is not None:
            req.node.id = node
        self.held |= set(held or {})
        try:
            events = self.machine.receive(req)  # type: ignore[arg-type]
        except ProtocolError as refused:
            assert self._breaks_a_bound(req, refused), (refused, req)
            note_event("stream ended: " + re.sub(r"\d+", "N", str(refused).split(" is ")[0][:48]))
            self.ended = True
            return
        for event in events:
            if isinstance(event, Nack):
                assert len(event.detail.encode()) <= FIELDS.error_detail
                self._remember(event)
        self._check_kept()
        self.pump()

    def _breaks_a_bound(self, req, refused: ProtocolError) -> bool:
        """Whether the refused request did break the protocol or a bound."""
        if isinstance(refused, ResourceLimitExceeded):
            return "max_subscription_bytes" in str(refused)
        held = getattr(req, "initial_resource_versions", {})
        names = (list(req.resource_names_subscribe) + list(held) if self.delta
                 else list(req.resource_names))
        over = [len(req.type_url.encode()) > FIELDS.type_url,
                len(req.response_nonce.encode()) > FIELDS.response_nonce,
                any(len(n.encode()) > FIELDS.resource_name for n in names),
                any(len(v.encode()) > FIELDS.version_info for v in held.values()),
                not self.delta and len(req.version_info.encode()) > FIELDS.version_info,
                self.machine.node is None and len(req.node.id.encode()) > FIELDS.node_id]
        return req.type_url == "" or any(over)

    def _check_kept(self) -> None:
        """What the machine keeps of the peer's strings is within their bounds."""
        machine = self.machine
        if machine.node is not None:
            assert len(machine.node.id.encode()) <= FIELDS.node_id
        assert machine.held_bytes <= BUDGET
        for state in machine.types.values():
            assert all(len(n.encode()) <= FIELDS.resource_name for n in state.names)
            assert state.name_bytes == names_size(state.names)
        if not self.delta:
            assert machine.held_bytes == sum(s.name_bytes for s in machine.types.values())

    def _remember(self, nack: Nack) -> None:
        full = not self.delta and nack.type_url in T.FULL_STATE_TYPES
        if full:
            sent = self.last[nack.type_url]
            self.rejected_states.add((nack.type_url, sent.version))
        else:
            self.rejected |= {(nack.type_url, n, v) for n, v in nack.rejected.items()}

    def pump(self) -> None:
        reference = copy.deepcopy(self.machine)
        for state in reference.types.values():
            state.evaluated = None  # forget what was evaluated: evaluate everything in full
        expected = reference.responses(self.snapshot)
        responses = self.machine.responses(self.snapshot)
        assert [_key(r) for r in responses] == [_key(r) for r in expected]
        encode = encode_delta if self.delta else encode_sotw
        for response in responses:
            assert len(encode(response)) + 5 <= self.machine.limits.max_response_bytes
            full = not self.delta and response.type_url in T.FULL_STATE_TYPES
            if full:
                assert (response.type_url, response.version) not in self.rejected_states
            for res in response.resources:
                assert (response.type_url, res.name, res.version) not in self.rejected
            self.last[response.type_url] = response

    def run(self, op: tuple) -> None:
        if op[0] == "snapshot":
            fresh = snapshot(op[1])
            self.snapshot = fresh.reusing(self.snapshot) if op[2] else fresh
            self.pump()
        elif op[0] == "reply":
            _, type_url, nack, names = op
            if type_url in self.last:
                resp = self.last[type_url]
                self.request(type_url, resp.nonce, names, nack, resp.version)
        else:
            _, type_url, nonce, names, error, version, node, detail, held = op
            self.request(type_url, nonce, names, error, version, node, detail, held)


# None: the default limits (nothing is split); 260: the fuzz snapshots' EDS goes out in parts of
# two CLAs, Delta CDS too; 200: also withholds SotW CDS (3 clusters) and the Listener.
LIMITS = [None, RESPONSE_HEADROOM + 260, RESPONSE_HEADROOM + 200]


def _limits(max_bytes: int | None) -> StreamLimits:
    bounds = {"fields": FIELDS, "max_subscription_bytes": BUDGET}
    return (StreamLimits(**bounds) if max_bytes is None  # type: ignore[arg-type]
            else StreamLimits(max_response_bytes=max_bytes, **bounds))  # type: ignore[arg-type]


@pytest.mark.parametrize("max_bytes", LIMITS, ids=["default", "parts", "withheld"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_sotw_never_resends_a_nacked_version(max_bytes, sequence):
    checker = Checker(SotwStream(limits=_limits(max_bytes)), delta=False)
    for op in sequence:
        checker.run(op)
    assert len(checker.machine.types) <= 4


@pytest.mark.parametrize("max_bytes", LIMITS, ids=["default", "parts", "withheld"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_delta_never_resends_a_nacked_version(max_bytes, sequence):
    checker = Checker(DeltaStream(limits=_limits(max_bytes)), delta=True)
    for op in sequence:
        checker.run(op)
    assert len(checker.machine.types) <= 4
    for state in checker.machine.types.values():
        assert set(state.sent) - {"a", "b", "c", "routes", "listener"} <= checker.held
