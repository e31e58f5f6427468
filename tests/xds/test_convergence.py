"""Convergence tracking: telemetry read -> ACK of the ClusterLoadAssignment, no gRPC."""

from __future__ import annotations

from tests.support.metrics import sample_value
from tests.support.xds_fixtures import BASE, snapshot
from xds_server.xds import type_urls as T
from xds_server.xds.convergence import Convergence, StreamConvergence


def _count(api: str) -> float:
    return sample_value("trimtab_convergence_seconds_count", api=api)
    return 0.0


def test_only_changed_assignments_are_stamped() -> None:
    tracker = Convergence()
    before = snapshot(BASE)
    assert tracker.published(before, read_at=10.0) == len(BASE)
    after = snapshot({**BASE, "a": {"10.0.0.1:80": 51, "10.0.0.2:80": 50}})
    assert tracker.published(after.reusing(before), read_at=12.0) == 1
    a, b = after.of_type(T.ENDPOINT)["a"], after.of_type(T.ENDPOINT)["b"]
    assert tracker.stamp_of("a", a.version) == 12.0
    assert tracker.stamp_of("b", b.version) == 10.0  # unchanged: keeps its first stamp


def test_a_config_only_publish_is_not_stamped() -> None:
    tracker = Convergence()
    assert tracker.published(snapshot(BASE), read_at=None) == 0
    assert not tracker.stamps


def test_an_ack_observes_its_oldest_delay_once() -> None:
    tracker = Convergence()
    snap = snapshot(BASE)
    tracker.published(snap, read_at=100.0)
    stream = StreamConvergence(tracker, api="unit")
    eds = tuple(snap.of_type(T.ENDPOINT).values())
    stream.sent(T.ENDPOINT, "n1", eds)
    stream.sent(T.CLUSTER, "n2", tuple(snap.of_type(T.CLUSTER).values()))
    before = _count("unit")
    assert stream.acked(T.CLUSTER, "n2", now=101.0) == []
    assert stream.acked(T.ENDPOINT, "n1", now=100.75) == [0.75] * len(eds)
    assert stream.acked(T.ENDPOINT, "n1", now=102.0) == []  # already observed
    assert _count("unit") == before + 1


def test_nacked_responses_are_forgotten_and_memory_is_bounded() -> None:
    tracker = Convergence(max_versions=3)
    first = snapshot(BASE)
    tracker.published(first, read_at=1.0)
    for step in range(5):
        nxt = snapshot({**BASE, "a": {"10.0.0.1:80": 60 + step, "10.0.0.2:80": 50}})
        tracker.published(nxt.reusing(first), read_at=2.0 + step)
        first = nxt
    assert len(tracker.stamps) == 3
    stream = StreamConvergence(tracker, api="unit")
    eds = tuple(first.of_type(T.ENDPOINT).values())
    for i in range(20):
        stream.sent(T.ENDPOINT, f"n{i}", eds)
    assert len(stream.pending) <= 8
    stream.nacked("n19")
    assert stream.acked(T.ENDPOINT, "n19", now=50.0) == []
