"""LeaseElector against the fake API server (real Lease JSON, resourceVersion, 409/410/5xx,
timeouts, partitions). Most tests step the elector by hand with a fake monotonic clock."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.support.fake_kube import FakeKube
from tests.support.metrics import sample_value
from tests.support.wait import wait_until, wait_until_async
from trimtab_dev.envoy_process import free_port
from xds_server.control.leader import LeaseElector, coordination_api_client

NS, NAME = "trimtab", "trimtab-leader"
LEASE_S, RENEW_S, DEADLINE_S = 3, 0.5, 2.0
# RFC 3339 with an offset: the client sends MicroTimes as datetime.isoformat() (UTC)
SAMPLING_SLACK_S = 0.4  # a sampling thread or loop on a busy 2-core box runs late by this much
MICROTIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?(Z|\+00:00)$")


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with FakeKube() as fake:
        yield fake


def elector(host: str, identity: str, clock: Clock | None = None, **options: Any
            ) -> LeaseElector:
    defaults: dict[str, Any] = {"lease_seconds": LEASE_S, "renew_seconds": RENEW_S,
                                "renew_deadline": DEADLINE_S}
    if clock is not None:
        defaults["monotonic"] = clock
    return LeaseElector(coordination_api_client(host), NS, NAME, identity,
                        **{**defaults, **options})


def lease(kube: FakeKube) -> dict[str, Any]:
    found = kube.get_object("leases", NAME, NS)
    assert found is not None
    return found


def test_acquire_creates_the_lease_in_the_api_shape(kube: FakeKube) -> None:
    a = elector(kube.host, "a", Clock())
    assert not a.is_leader()
    assert a.step() is True and a.is_leader()
    obj = lease(kube)
    assert obj["apiVersion"] == "coordination.k8s.io/v1" and obj["kind"] == "Lease"
    spec = obj["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == LEASE_S
    assert spec["leaseTransitions"] == 0
    assert MICROTIME.match(spec["acquireTime"]) and MICROTIME.match(spec["renewTime"])
    assert [r.op for r in kube.object_records("leases")] == ["get", "create"]
    assert a.state().document()["leader"] == "a"


def test_renew_replaces_over_the_read_version_and_keeps_acquire_time(kube: FakeKube) -> None:
    clock = Clock()
    a = elector(kube.host, "a", clock)
    a.step()
    first = lease(kube)
    time.sleep(0.01)  # renewTime has microseconds: the renewal changes it
    clock.advance(RENEW_S)
    assert a.step() is True
    second = lease(kube)
    assert second["spec"]["acquireTime"] == first["spec"]["acquireTime"]
    assert second["spec"]["renewTime"] > first["spec"]["renewTime"]
    assert second["spec"]["leaseTransitions"] == 0
    (replace,) = kube.object_records("leases", "replace")
    assert replace.resource_version == first["metadata"]["resourceVersion"]
    assert int(second["metadata"]["resourceVersion"]) > int(replace.resource_version)


def test_leadership_ends_at_the_renew_deadline_without_any_io(kube: FakeKube) -> None:
    clock = Clock()
    a = elector(kube.host, "a", clock)
    a.step()
    clock.advance(DEADLINE_S - 0.01)
    assert a.is_leader()
    requests = len(kube.object_requests)
    clock.advance(0.02)
    assert not a.is_leader()  # no renewal within the deadline: not leading, at once
    assert len(kube.object_requests) == requests


def test_another_candidate_takes_over_only_after_the_lease_expires_as_it_measures(
        kube: FakeKube) -> None:
    a_clock, b_clock = Clock(), Clock(50.0)
    a, b = elector(kube.host, "a", a_clock), elector(kube.host, "b", b_clock)
    a.step()
    assert b.step() is False and not b.is_leader()  # held: B sees it now (its t=50)
    b_clock.advance(LEASE_S - 0.1)
    assert b.step() is False  # unchanged record, but not yet lease_seconds since B saw it
    a_clock.advance(RENEW_S)
    a.step()  # A renews: the record changes, B's observation clock restarts
    assert b.step() is False
    b_clock.advance(LEASE_S - 0.1)
    assert b.step() is False
    b_clock.advance(0.2)
    assert b.step() is True and b.is_leader()
    spec = lease(kube)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    a_clock.advance(RENEW_S)
    assert a.step() is False and not a.is_leader()  # A sees B holding it: stops at once
    assert lease(kube)["spec"]["holderIdentity"] == "b"


def test_conflict_on_a_concurrent_update_is_never_overwritten(kube: FakeKube) -> None:
    clock = Clock()
    a = elector(kube.host, "a", clock)
    a.step()

    def intruder(obj: dict[str, Any]) -> None:
        obj["spec"]["holderIdentity"] = "intruder"

    kube.modify_before("leases", "replace", intruder)  # lands between A's read and replace
    clock.advance(RENEW_S)
    assert a.step() is False
    replaces = kube.object_records("leases", "replace")
    assert [r.status for r in replaces] == [409]
    assert lease(kube)["spec"]["holderIdentity"] == "intruder"
    clock.advance(RENEW_S)
    assert a.step() is False and not a.is_leader()  # re-read: someone else holds it
    assert lease(kube)["spec"]["holderIdentity"] == "intruder"
    assert all(r.resource_version for r in kube.object_records("leases", "replace"))


def test_create_race_lost_with_already_exists(kube: FakeKube) -> None:
    a, b = elector(kube.host, "a", Clock()), elector(kube.host, "b", Clock())
    kube.delay_objects("leases", "get", 0.3)  # A reads "absent", B creates meanwhile

    def b_creates() -> None:
        time.sleep(0.05)
        b.step()

    racer = threading.Thread(target=b_creates)
    kube.fail_objects("leases", "get", 404, count=2)  # both read "absent"
    racer.start()
    assert a.step() is False  # its create got 409 AlreadyExists
    racer.join(5)
    assert b.is_leader() and not a.is_leader()
    creates = kube.object_records("leases", "create")
    assert sorted(r.status for r in creates) == [201, 409]


@pytest.mark.parametrize("status", [410, 500, 503, 429])
def test_api_errors_past_the_deadline_stop_leading_then_it_renews(kube: FakeKube,
                                                                  status: int) -> None:
    clock = Clock()
    a = elector(kube.host, "a", clock)
    a.step()
    kube.fail_objects("leases", "get", status, count=4)
    for _ in range(3):
        clock.advance(RENEW_S)
        assert a.step() is False
    assert a.is_leader()  # 1.5 s of errors: still within the 2 s deadline
    clock.advance(RENEW_S)
    assert a.step() is False and not a.is_leader()
    assert str(status) in (a.state().last_error or "")
    assert lease(kube)["spec"]["holderIdentity"] == "a"  # nobody else took it: it may renew
    clock.advance(RENEW_S)
    assert a.step() is True and a.is_leader() and a.state().last_error is None


def test_a_request_that_times_out_fails_the_attempt_within_its_timeout(kube: FakeKube) -> None:
    a = elector(kube.host, "a", Clock(), request_timeout=0.3)
    kube.delay_objects("leases", "get", 3.0)
    started = time.monotonic()
    assert a.step() is False
    assert time.monotonic() - started < 1.5
    assert "Timeout" in (a.state().last_error or "") or "timed out" in (a.state().last_error
                                                                        or "")
    assert kube.get_object("leases", NAME, NS) is None  # nothing was written
    assert not a.is_leader()


def test_an_unreachable_api_never_leads() -> None:
    a = elector(f"http://127.0.0.1:{free_port()}", "a", Clock(), request_timeout=0.3)
    for _ in range(3):
        assert a.step() is False
    assert not a.is_leader() and "Error" in (a.state().last_error or "")


@pytest.mark.parametrize("skew_hours", [-1.0, 1.0])
def test_clock_skew_between_replicas_changes_nothing(kube: FakeKube, skew_hours: float
                                                     ) -> None:
    """A's wall clock is an hour off: its renewTimes lie in B's past (or future). B never
    compares them with its own clock: it takes over exactly lease_seconds after it saw the
    last change, not earlier (past) and not an hour later (future)."""
    skewed = timedelta(hours=skew_hours)
    a_clock, b_clock = Clock(), Clock()
    a = elector(kube.host, "a", a_clock, wall=lambda: datetime.now(UTC) + skewed)
    b = elector(kube.host, "b", b_clock)
    a.step()
    for _ in range(8):  # A keeps renewing: B never takes over, whatever renewTime says
        time.sleep(0.002)
        a_clock.advance(RENEW_S)
        b_clock.advance(RENEW_S)
        assert a.step() is True
        assert b.step() is False
    b_clock.advance(LEASE_S - 0.1)  # A has stopped renewing
    assert b.step() is False
    b_clock.advance(0.2)
    assert b.step() is True


def test_release_hands_the_lease_over_at_once(kube: FakeKube) -> None:
    a, b = elector(kube.host, "a", Clock()), elector(kube.host, "b", Clock())
    a.step()
    assert b.step() is False
    assert a.release() is True and not a.is_leader()
    spec = lease(kube)["spec"]
    assert spec.get("holderIdentity") is None and spec["leaseDurationSeconds"] == 1
    assert b.step() is True  # no holder: taken without waiting
    assert a.release() is False  # B's now: A never releases another's Lease
    assert lease(kube)["spec"]["holderIdentity"] == "b"


def test_a_partitioned_leader_stops_leading_before_another_can_take_the_lease(
        kube: FakeKube) -> None:
    """Real threads and time: A and B reach the API on their own ports; A's is cut. A stops
    leading (is_leader False) strictly before B leads, and they never both lead."""
    a_port, b_port = kube.add_port(), kube.add_port()
    options = {"lease_seconds": 2, "renew_seconds": 0.2, "renew_deadline": 1.2,
               "request_timeout": 0.2}
    a = elector(kube.host_on(a_port), "a", **options)
    b = elector(kube.host_on(b_port), "b", **options)
    a.start()
    wait_until(a.is_leader, 5, "A to lead", every=0.01)
    b.start()
    samples: list[tuple[float, bool, bool]] = []
    try:
        time.sleep(0.5)
        kube.partition(a_port)
        cut_at = time.monotonic()
        while time.monotonic() < cut_at + 6 and not b.is_leader():
            samples.append((time.monotonic(), a.is_leader(), b.is_leader()))
            time.sleep(0.005)
        samples.append((time.monotonic(), a.is_leader(), b.is_leader()))
    finally:
        kube.partition(a_port, cut=False)
        a.stop(release=False)
        b.stop(release=False)
    assert not any(ra and rb for _, ra, rb in samples), "both led at once"
    a_stopped = next(t for t, ra, _ in samples if not ra)
    b_leads = next(t for t, _, rb in samples if rb)
    assert a_stopped < b_leads
    # within the renew deadline of its last renewal (+ the sampler's own scheduling)
    assert a_stopped - cut_at <= 1.2 + SAMPLING_SLACK_S
    assert b_leads - cut_at <= 2 + 0.2 + 0.5  # lease_seconds + one retry (+ request time)


def test_the_loop_learns_of_a_lost_lease_at_the_deadline_though_the_thread_is_stuck(
        kube: FakeKube) -> None:
    """The thread hangs in a request to a black-holed API; the loop's timer still flips
    `trimtab_leader` to 0 and reports the loss at the renew deadline."""
    port = kube.add_port()
    changes: list[tuple[float, bool]] = []
    a = elector(kube.host_on(port), "stuck", lease_seconds=4, renew_seconds=0.2,
                renew_deadline=1.0, request_timeout=3.0,
                on_change=lambda state: changes.append((time.monotonic(), state.leading)))

    async def scenario() -> tuple[float, float]:
        a.start()
        await wait_until_async(a.is_leader, 10.0, "A to lead")
        await asyncio.sleep(0.1)
        assert sample_value("trimtab_leader", identity="stuck") == 1
        kube.partition(port)
        cut_at = time.monotonic()
        await wait_until_async(lambda: sample_value("trimtab_leader", identity="stuck"), 10.0,
                               "trimtab_leader to drop to 0", check=lambda v: v != 1)
        return cut_at, time.monotonic()

    try:
        cut_at, flipped_at = asyncio.run(scenario())
    finally:
        kube.partition(port, cut=False)
        a.stop(release=False)
    assert flipped_at - cut_at <= 1.0 + SAMPLING_SLACK_S  # the deadline, not the 3 s timeout
    assert [leading for _, leading in changes] == [True, False]


def _claim_forever(spec: dict[str, Any]) -> None:
    spec["holderIdentity"] = "ghost\nwith a newline " + "x" * 5000
    spec["leaseDurationSeconds"] = 2**31 - 1


def test_a_lease_claiming_a_huge_duration_is_taken_over_at_the_cap(
        kube: FakeKube, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 26 §6: a holder that claims leaseDurationSeconds 2^31-1 and never renews kept
    every replica from leading; its claim counts for at most 10 x our lease_seconds."""
    a = elector(kube.host, "a", Clock())
    a.step()
    kube.modify("leases", NAME, lambda obj: _claim_forever(obj["spec"]), NS)
    clock = Clock()
    b = elector(kube.host, "b", clock)
    with caplog.at_level("WARNING", logger="trimtab.leader"):
        assert b.step() is False  # held: B sees it change now
        clock.advance(10 * LEASE_S - 0.1)
        assert b.step() is False  # within the cap: still the ghost's
        clock.advance(0.2)
        assert b.step() is True and b.is_leader()
    spec = lease(kube)["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseDurationSeconds"] == LEASE_S
    capped = [r.getMessage() for r in caplog.records if "claims leaseDurationSeconds" in
              r.getMessage()]
    assert len(capped) == 1, capped  # once per claim, not every retry
    assert f"claims leaseDurationSeconds {2**31 - 1}; counting at most {10 * LEASE_S}" in \
        capped[0]
    assert "\n" not in capped[0] and len(capped[0]) < 400  # the holder bounded and escaped
    assert b.max_peer_lease_seconds == 10 * LEASE_S


def test_a_claim_within_the_cap_is_honoured_as_claimed(kube: FakeKube) -> None:
    a = elector(kube.host, "a", Clock())
    a.step()
    kube.modify("leases", NAME, lambda obj: obj["spec"].update(leaseDurationSeconds=2 * LEASE_S),
                NS)
    clock = Clock()
    b = elector(kube.host, "b", clock)
    assert b.step() is False
    clock.advance(2 * LEASE_S - 0.1)
    assert b.step() is False  # longer than B's own lease_seconds, and honoured
    clock.advance(0.2)
    assert b.step() is True
