"""CoordinatedRollouts + ConfigMapStateStore against the fake API server: only the leader
advances and writes (over the resourceVersion it read), followers route by the ConfigMap
within one tick, a 409 re-reads and re-decides, failover resumes at the same step."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.control.test_rollouts_controller import CANARY, STABLE, Feed, GoodTracker, page, split
from tests.support.fake_kube import FakeKube
from tests.support.wait import wait_until
from xds_server.admin.api import AdminApi
from xds_server.config.load import ConfigError, parse_config
from xds_server.control.controller import Controller
from xds_server.control.coordination import CoordinatedRollouts, warn_deprecated_drive
from xds_server.control.leader import LeaderState, LeaseElector, coordination_api_client
from xds_server.control.rollouts import machine as rollout
from xds_server.control.rollouts.machine import (
    ABORTED,
    PROGRESSING,
    PROMOTED,
    RolloutCommandError,
    from_json,
    load_state,
)
from xds_server.control.rollouts.state import (
    STATE_KEY,
    WRITER_ANNOTATION,
    ConfigMapStateStore,
    FileStateStore,
    StateConflict,
)
from xds_server.xds.cache import SnapshotCache

NS, CM = "trimtab", "trimtab-rollouts"


def config() -> Any:
    return parse_config({
        "coordination": {"kubernetes": {"namespace": NS, "lease_seconds": 3,
                                        "renew_seconds": 0.5}},
        "pools": [{"name": "p", "model": "m",
                   "versions": {"stable": {"endpoints": [{"address": STABLE}]},
                                "canary": {"endpoints": [{"address": CANARY}]}},
                   "rollout": {"start_percent": 10, "step_percent": 10,
                               "step_interval_seconds": 10, "max_percent": 30,
                               "gates": {"min_requests": 5}}}]})


@dataclass
class FakeLeader:
    """A Leader whose answer the test sets (the Lease itself is tested in test_leader.py)."""

    identity: str
    leading: bool = False
    holder: str | None = None

    def is_leader(self) -> bool:
        return self.leading

    def state(self) -> LeaderState:
        return LeaderState(self.identity, self.leading,
                           self.identity if self.leading else self.holder, f"{NS}/lease")


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def replica(kube: FakeKube, identity: str, leading: bool, host: str | None = None
            ) -> tuple[CoordinatedRollouts, FakeLeader]:
    leader = FakeLeader(identity, leading)
    store = ConfigMapStateStore(coordination_api_client(host or kube.host), NS, CM, identity,
                                request_timeout=0.5)
    return CoordinatedRollouts(config(), store, leader), leader


def tick(rollouts: CoordinatedRollouts, now: float) -> bool:
    return asyncio.run(rollouts.atick(GoodTracker(), now))


def stored(kube: FakeKube) -> dict[str, Any]:
    obj = kube.get_object("configmaps", CM, NS)
    assert obj is not None
    return {"states": from_json(obj["data"][STATE_KEY]), "obj": obj}


def writes(kube: FakeKube) -> list[Any]:
    return [r for r in kube.object_records("configmaps") if r.op in ("create", "replace")]


def event_lines(caplog: pytest.LogCaptureFixture, kind: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trimtab.rollout" and r.getMessage().startswith(f"rollout p: {kind} ")]


def test_only_the_leader_writes_and_a_follower_routes_by_the_configmap_within_one_tick(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trimtab.rollout")
    clock = [0.0]
    feed = Feed()
    feed.pages = {STABLE: page(0, 0), CANARY: page(0, 0)}
    a, _ = replica(kube, "a", leading=True)
    b, _ = replica(kube, "b", leading=False)
    leader_cache, follower_cache = SnapshotCache(), SnapshotCache()
    leader = Controller(config(), leader_cache, scraper=feed, clock=lambda: clock[0], rollouts=a)
    follower = Controller(config(), follower_cache, scraper=feed, clock=lambda: clock[0],
                          rollouts=b)
    asyncio.run(follower.tick())  # nothing stored yet: a follower starts nothing
    assert b.states == {} and writes(kube) == []
    asyncio.run(leader.tick())
    asyncio.run(follower.tick())
    assert split(follower_cache) == split(leader_cache) == {"p": 900, "p-canary": 100}
    clock[0] = 10.0
    feed.pages = {STABLE: page(100, 95), CANARY: page(100, 95)}  # counters grow: both pass
    asyncio.run(leader.tick())
    assert split(leader_cache) == {"p": 800, "p-canary": 200}
    asyncio.run(follower.tick())  # the next tick routes by it
    assert split(follower_cache) == {"p": 800, "p-canary": 200}
    assert b.states["p"] == a.states["p"] == stored(kube)["states"]["p"]
    assert [w.op for w in writes(kube)] == ["create", "replace"]
    assert stored(kube)["obj"]["metadata"]["annotations"][WRITER_ANNOTATION] == "a"
    assert all(w.resource_version for w in writes(kube) if w.op == "replace")
    assert len(event_lines(caplog, "start")) == 1 and len(event_lines(caplog, "step")) == 1


def test_failover_resumes_at_the_same_step_and_step_clock(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trimtab.rollout")
    a, a_lease = replica(kube, "a", leading=True)
    b, b_lease = replica(kube, "b", leading=False)
    for now in (0.0, 10.0):
        tick(a, now)
        tick(b, now)
    assert stored(kube)["states"]["p"].step_started_at == 10.0
    a_lease.leading = False  # A is gone (crash or partition); B takes the Lease
    b_lease.leading = True
    tick(b, 15.0)  # only 5 s into the step: the step clock came from the ConfigMap
    state = stored(kube)["states"]["p"]
    assert (state.percent, state.step, state.step_started_at) == (20, 1, 10.0)
    tick(b, 20.0)
    tick(b, 21.0)
    state = stored(kube)["states"]["p"]
    assert (state.percent, state.step, state.step_started_at) == (30, 2, 20.0)
    tick(b, 30.0)
    assert stored(kube)["states"]["p"].phase == PROMOTED
    steps = [e for e in stored(kube)["states"]["p"].history if e.kind == "step"]
    assert [e.percent for e in steps] == [20, 30]
    assert [m.split(":")[1].strip() for m in event_lines(caplog, "step")] == [
        "step at 20%", "step at 30%"]  # each logged once, A's by A, B's by B
    assert len(event_lines(caplog, "promote")) == 1


def test_a_conflict_rereads_and_redecides_and_never_overwrites_an_abort(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trimtab.rollout")
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    aborted = stored(kube)["states"]["p"]
    aborted = rollout.command(aborted, "abort", rollout.RolloutConfig(), 9.0)

    def operator_aborts(obj: dict[str, Any]) -> None:
        obj["data"][STATE_KEY] = rollout.to_json({"p": aborted})

    kube.modify_before("configmaps", "replace", operator_aborts)  # between read and write
    tick(a, 10.0)  # would step to 20 %
    assert [w.status for w in writes(kube)] == [201, 409]  # the second write: refused
    state = stored(kube)["states"]["p"]
    assert state.phase == ABORTED and state.percent == 0
    assert a.states["p"] == state  # re-read and re-decided: nothing to do on an abort
    assert event_lines(caplog, "step") == []
    tick(a, 30.0)
    assert stored(kube)["states"]["p"].phase == ABORTED


def test_an_abort_just_before_the_leader_dies_stays_aborted(kube: FakeKube) -> None:
    a, a_lease = replica(kube, "a", leading=True)
    b, b_lease = replica(kube, "b", leading=False)
    tick(a, 0.0)
    state = asyncio.run(a.acommand("p", "abort", 5.0))
    assert state.phase == ABORTED
    assert stored(kube)["states"]["p"].phase == ABORTED  # persisted before the answer
    a_lease.leading, b_lease.leading = False, True  # A dies right after answering
    for now in (6.0, 20.0, 40.0):
        tick(b, now)
    assert stored(kube)["states"]["p"].phase == ABORTED and b.percents() == {"p": 0}


def test_followers_refuse_commands_and_name_the_leader(kube: FakeKube) -> None:
    a, _ = replica(kube, "a", leading=True)
    b, b_lease = replica(kube, "b", leading=False)
    b_lease.holder = "a"
    tick(a, 0.0)
    assert a.drive and not b.drive
    assert "the leader is a" in b.refusal()
    with pytest.raises(RolloutCommandError, match="does not lead"):
        asyncio.run(b.acommand("p", "pause", 1.0))
    assert stored(kube)["states"]["p"].phase == PROGRESSING
    assert b.leader_document()["leading"] is False and b.leader_document()["leader"] == "a"


def test_admin_refuses_a_follower_command_with_409_naming_the_leader(kube: FakeKube) -> None:
    b, b_lease = replica(kube, "b", leading=False)
    b_lease.holder = "a"
    controller = Controller(config(), SnapshotCache(), scraper=Feed(), rollouts=b)
    api = AdminApi(controller, lambda: True)

    async def call() -> tuple[int, dict[str, Any], dict[str, Any]]:
        from aiohttp.test_utils import TestClient, TestServer
        async with TestClient(TestServer(api.app())) as client:
            posted = await client.post("/v1/rollouts/p/pause", json={})
            listed = await client.get("/v1/rollouts")
            return posted.status, await posted.json(), await listed.json()

    status, body, listed = asyncio.run(call())
    assert status == 409 and "the leader is a" in body["error"]["message"]
    assert listed["leader"]["identity"] == "b" and listed["leader"]["leader"] == "a"


@pytest.mark.parametrize("fault", ["http-500", "http-410", "timeout", "corrupt"])
def test_an_unreadable_state_is_never_decided_on(kube: FakeKube, fault: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    before = stored(kube)["obj"]["metadata"]["resourceVersion"]
    if fault.startswith("http-"):
        kube.fail_objects("configmaps", "get", int(fault[5:]))
    elif fault == "timeout":
        kube.delay_objects("configmaps", "get", 2.0)
    else:
        kube.modify("configmaps", CM, lambda o: o["data"].update({STATE_KEY: "{"}), NS)
        before = stored_rv(kube)
    started = time.monotonic()
    assert tick(a, 10.0) is False  # would step, but the state could not be read
    assert time.monotonic() - started < 1.5
    assert stored_rv(kube) == before and a.states["p"].percent == 10
    assert "cannot read the rollout state" in caplog.text


def stored_rv(kube: FakeKube) -> str:
    obj = kube.get_object("configmaps", CM, NS)
    assert obj is not None
    return obj["metadata"]["resourceVersion"]


def test_a_failed_write_advances_nothing_and_the_next_tick_steps_once(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trimtab.rollout")
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    kube.fail_objects("configmaps", "replace", 500)
    tick(a, 10.0)
    assert a.states["p"].percent == 10 and stored(kube)["states"]["p"].percent == 10
    assert event_lines(caplog, "step") == []
    tick(a, 10.5)
    assert stored(kube)["states"]["p"].percent == 20 and len(event_lines(caplog, "step")) == 1


def test_a_leader_partitioned_from_the_lease_stops_writing_before_anyone_else_may_lead(
        kube: FakeKube) -> None:
    """A's Lease link is cut while its ConfigMap link still works: once A's renew deadline
    passes it writes nothing more, although writes would go through, and B cannot have
    the Lease yet."""
    lease_port = kube.add_port()
    options = {"lease_seconds": 3, "renew_seconds": 0.2, "renew_deadline": 1.0,
               "request_timeout": 0.2}
    a_elector = LeaseElector(coordination_api_client(kube.host_on(lease_port)), NS, "lease",
                             "a", **options)
    b_elector = LeaseElector(coordination_api_client(kube.host), NS, "lease", "b", **options)
    store = ConfigMapStateStore(coordination_api_client(kube.host), NS, CM, "a")
    a = CoordinatedRollouts(config(), store, a_elector)
    a_elector.start()
    try:
        wait_until(a_elector.is_leader, 5, "A to lead", every=0.01)
        b_elector.start()
        tick(a, 0.0)
        assert len(writes(kube)) == 1
        kube.partition(lease_port)
        cut_at = time.monotonic()
        wait_until(lambda: not a_elector.is_leader(), 10, "A to stop leading", every=0.01)
        assert time.monotonic() - cut_at <= 1.0 + 0.4  # the deadline + sampling on a busy box
        assert not b_elector.is_leader()  # B has to wait lease_seconds from its last look
        tick(a, 10.0)  # a step is due and the ConfigMap is reachable
        assert len(writes(kube)) == 1 and stored(kube)["states"]["p"].percent == 10
        assert not a.drive
    finally:
        kube.partition(lease_port, cut=False)
        a_elector.stop(release=False)
        b_elector.stop(release=False)


def test_drive_is_deprecated_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    base = {"pools": [{"name": "p", "model": "m", "endpoints": [{"address": STABLE}]}]}
    warn_deprecated_drive(parse_config(base))
    assert "deprecated" not in caplog.text
    warn_deprecated_drive(parse_config({**base, "rollouts": {"drive": False}}))
    assert "rollouts.drive is deprecated: it stays as an override for embedded mode" in (
        caplog.text)
    warn_deprecated_drive(parse_config({**base, "rollouts": {"drive": True},
                                        "coordination": {"kubernetes": {"namespace": "n"}}}))
    assert "deprecated and ignored" in caplog.text


def test_coordination_timing_is_validated() -> None:
    bad = {"pools": [{"name": "p", "model": "m", "endpoints": [{"address": STABLE}]}],
           "coordination": {"kubernetes": {"namespace": "n", "lease_seconds": 2,
                                           "renew_seconds": 2}}}
    with pytest.raises((ConfigError, ValueError), match="must stop leading"):
        parse_config(bad)
    good = parse_config({**bad, "coordination": {"kubernetes": {"namespace": "n"}}})
    k8s = good.coordination.kubernetes
    assert k8s is not None and (k8s.lease_seconds, k8s.renew_seconds, k8s.renew_deadline) == (
        15, 2.0, 10.0)


def test_configmap_store_round_trip_and_conflict(kube: FakeKube) -> None:
    store = ConfigMapStateStore(coordination_api_client(kube.host), NS, CM, "a")
    empty = store.load()
    assert empty.states == {} and empty.version is None
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    loaded = store.load()
    assert loaded.states == a.states and loaded.version == stored_rv(kube)
    new_version = store.save(loaded.states, loaded.version)
    assert new_version == stored_rv(kube) != loaded.version
    with pytest.raises(StateConflict):
        store.save(loaded.states, loaded.version)  # stale version: refused, not overwritten
    with pytest.raises(StateConflict):
        store.save(loaded.states, None)  # "absent when read": create gets AlreadyExists
    assert json.loads(stored(kube)["obj"]["data"][STATE_KEY])["version"] == 1


def test_a_write_keeps_the_labels_and_annotations_it_read(kube: FakeKube) -> None:
    """deploy/ ships the ConfigMap (RBAC allows get and update of it only): trimtab's writes
    keep what kubectl and kustomize put on it."""
    store = ConfigMapStateStore(coordination_api_client(kube.host), NS, CM, "a")
    shipped = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": CM, "namespace": NS,
                            "labels": {"app.kubernetes.io/part-of": "trimtab"},
                            "annotations": {"kubectl.kubernetes.io/last-applied-configuration":
                                            "{}"}}}
    request = urllib.request.Request(f"{kube.host}/api/v1/namespaces/{NS}/configmaps",
                                     data=json.dumps(shipped).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert resp.status == 201
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    meta = stored(kube)["obj"]["metadata"]
    assert meta["labels"] == {"app.kubernetes.io/part-of": "trimtab"}
    assert meta["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] == "{}"
    assert meta["annotations"][WRITER_ANNOTATION] == "a"
    assert [w.op for w in writes(kube)] == ["create", "replace"]  # the shipped one, then ours
    assert store.load().states == a.states


def test_a_reload_that_changes_coordination_is_refused_naming_the_key() -> None:
    from xds_server.app import restart_only_changes
    old = config()
    data = old.model_dump(mode="json")
    data["coordination"]["kubernetes"]["lease_seconds"] = 30
    assert restart_only_changes(old, parse_config(data)) == [
        "coordination.kubernetes.lease_seconds"]


def test_the_file_backend_behind_the_same_interface(tmp_path) -> None:
    """Embedded mode keeps the state file; CoordinatedRollouts works over it as well."""
    store = FileStateStore(tmp_path / "rollouts.json")
    assert store.load().states == {}
    leader = FakeLeader("solo", leading=True)
    rollouts = CoordinatedRollouts(config(), store, leader)
    tick(rollouts, 0.0)
    tick(rollouts, 10.0)
    assert load_state(tmp_path / "rollouts.json")["p"].percent == 20
    assert store.load().states == rollouts.states
    (tmp_path / "rollouts.json").write_text("{")
    assert tick(rollouts, 20.0) is False and rollouts.states["p"].percent == 20


def test_a_slow_api_holds_a_tick_up_only_for_the_read_budget(kube: FakeKube,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """The state read is budgeted: the tick goes on with the last state (the weights are not
    held up), the read finishes in its thread, and the next tick uses a fresh one."""
    leader = FakeLeader("a", leading=True)
    store = ConfigMapStateStore(coordination_api_client(kube.host), NS, CM, "a",
                                request_timeout=5.0)
    a = CoordinatedRollouts(config(), store, leader, read_budget_s=0.2)

    async def scenario() -> tuple[float, bool, bool]:
        assert await a.atick(GoodTracker(), 0.0)
        kube.delay_objects("configmaps", "get", 1.0)
        started = time.monotonic()
        slow = await a.atick(GoodTracker(), 10.0)  # a step is due, the read is slow
        took = time.monotonic() - started
        await asyncio.sleep(1.2)  # the slow read ends in its thread
        return took, slow, await a.atick(GoodTracker(), 10.5)

    took, slow, later = asyncio.run(scenario())
    assert took < 0.6 and slow is False
    assert "took over 0.2s" in caplog.text
    assert later is True and stored(kube)["states"]["p"].percent == 20
    assert [w.status for w in writes(kube)] == [201, 200]


def test_the_fake_answers_a_stale_replace_with_the_apis_conflict_status(kube: FakeKube) -> None:
    a, _ = replica(kube, "a", leading=True)
    tick(a, 0.0)
    obj = stored(kube)["obj"]
    stale = {**obj, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
    request = urllib.request.Request(f"{kube.host}/api/v1/namespaces/{NS}/configmaps/{CM}",
                                     data=json.dumps(stale).encode(), method="PUT",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    body = json.loads(caught.value.read())
    assert caught.value.code == 409
    assert {k: body[k] for k in ("kind", "apiVersion", "status", "reason", "code")} == {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict",
        "code": 409}
    assert body["details"] == {"name": CM, "group": "", "kind": "configmaps"}
    assert "the object has been modified" in body["message"]
    assert stored_rv(kube) == obj["metadata"]["resourceVersion"]  # nothing was written
