"""Leader election with a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does.

Every replica runs one :class:`LeaseElector`. It talks to the API server with the official
``kubernetes`` client (``CoordinationV1Api``: read, create, replace with ``resourceVersion``)
in a dedicated thread, because that client is synchronous; the event loop only reads
:meth:`LeaseElector.is_leader` (a lock-protected deadline check, never I/O) and gets state
changes handed over with ``call_soon_threadsafe``. Serving never waits on it.

The algorithm is client-go's ``tryAcquireOrRenew`` (the same Lease fields, so other tools
read the Lease as usual). We do not use ``kubernetes.leaderelection`` itself: its
``LeaderElection.run`` cannot be stopped, builds its own default API client, sends requests
without a timeout (a black-holed link hangs it for ever) and measures time on the wall clock.

- **Acquire.** Read the Lease; create it when absent (a 409 ``AlreadyExists``: someone was
  first). A Lease held by another identity is taken over only once it has not changed for its
  ``leaseDurationSeconds`` *as measured on this replica's monotonic clock from when this
  replica saw it change* (client-go's observedTime): the holder's ``renewTime`` is never
  compared with our clock, so clock skew between replicas does not matter. A Lease without a
  holder (released) is taken at once. The duration a holder's Lease claims counts for at most
  ``MAX_PEER_LEASE_FACTOR`` times our own ``lease_seconds``: a Lease that claims
  ``leaseDurationSeconds: 2147483647`` and is never renewed expires after that cap, as this
  replica measures it, instead of keeping every replica from leading. Every write is a replace carrying the read
  ``resourceVersion``: a 409 ``Conflict`` means another replica wrote first, and this attempt
  fails (nothing is overwritten).
- **Lead.** A replica leads until ``renew_deadline`` after the *start* of its last successful
  acquire or renew (:meth:`is_leader` checks the deadline itself, so a thread stuck in a
  request cannot extend it). A challenger waits ``lease_seconds`` from when it *saw* that
  renewal, which is after it was sent, and ``renew_deadline < lease_seconds``: the old leader
  stops leading before anyone can take the Lease, whether it crashed, is partitioned or its
  API calls fail (5xx, 410, timeouts). One that cannot reach the API never believes it leads.
  Seeing another holder in the Lease stops leading at once.
- **Release.** :meth:`stop` stops leading first, then hands the Lease back (holder cleared,
  ``leaseDurationSeconds: 1``, as client-go's ReleaseOnCancel) so a rolling update fails over
  in one retry period instead of a lease duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from xds_server.admin.metrics import LEADER
from xds_server.config.schema import KubernetesCoordinationConfig
from xds_server.control.discovery.kubernetes import make_api_client

log = logging.getLogger("trimtab.leader")

LEASE_API_VERSION = "coordination.k8s.io/v1"
HTTP_NOT_FOUND, HTTP_CONFLICT = 404, 409
# A holder's claimed leaseDurationSeconds counts for at most this many of our lease_seconds
# (replicas of one deployment claim the same; a rolling update may change it within this).
MAX_PEER_LEASE_FACTOR = 10
MAX_SHOWN_HOLDER_CHARS = 128  # of a holder identity in a log line
# What a failed API call raises: the API's error Status, or the transport's (timeouts,
# refused or reset connections), or a body that is not JSON.
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


def micro_time(moment: datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with six fractional digits."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc_now() -> datetime:
    return datetime.now(UTC)


def default_identity() -> str:
    """``$POD_NAME`` (the Deployment sets it from the downward API), else host + random, so
    two processes on one host never share an identity."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except ValueError:
            message = None
        return f"HTTP {exc.status} {exc.reason or ''}".strip() + (f": {message}" if message
                                                                   else "")
    return f"{type(exc).__name__}: {exc}"


def shown_holder(holder: str | None) -> str:
    """A holder identity (any replica's, or anyone's who can write the Lease) as it may
    appear in a log line: bounded and escaped."""
    if holder is None:
        return "nobody"
    shown = repr(holder[:MAX_SHOWN_HOLDER_CHARS])
    return shown + ("..." if len(holder) > MAX_SHOWN_HOLDER_CHARS else "")


def coordination_api_client(api_server: str | None) -> k8s_client.ApiClient:
    """An ApiClient like :func:`make_api_client`'s, with urllib3's own retries off: an
    attempt must end within its timeout, the elector retries on its own schedule."""
    base = make_api_client(api_server)
    configuration = base.configuration
    configuration.retries = False
    return k8s_client.ApiClient(configuration)


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of a Lease's spec."""

    holder: str | None
    duration_s: int | None
    acquire_time: str | None
    renew_time: str | None
    transitions: int

    @classmethod
    def of(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        duration = spec.get("leaseDurationSeconds")
        usable = isinstance(duration, int) and not isinstance(duration, bool) and duration > 0
        return cls(spec.get("holderIdentity") or None, duration if usable else None,
                   spec.get("acquireTime"), spec.get("renewTime"),
                   int(spec.get("leaseTransitions") or 0))


@dataclass(frozen=True)
class LeaderState:
    """What the admin API and the metric show."""

    identity: str
    leading: bool
    holder: str | None  # the holder last seen in the Lease (None: none, or not read yet)
    lease: str  # namespace/name
    last_error: str | None = None

    def document(self) -> dict[str, Any]:
        return {"identity": self.identity, "leading": self.leading, "leader": self.holder,
                "lease": self.lease, "last_error": self.last_error}


class LeaseElector:
    """See the module docstring. ``monotonic`` and ``wall`` are injectable for tests; the
    thread calls :meth:`step` every ``renew_seconds``; tests may call it directly."""

    def __init__(self, api_client: k8s_client.ApiClient, namespace: str, name: str,
                 identity: str, *, lease_seconds: int, renew_seconds: float,
                 renew_deadline: float, request_timeout: float | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 wall: Callable[[], datetime] = utc_now,
                 on_change: Callable[[LeaderState], None] | None = None) -> None:
        if not renew_seconds < renew_deadline < lease_seconds:
            raise ValueError("expected renew_seconds < renew_deadline < lease_seconds")
        self._api = k8s_client.CoordinationV1Api(api_client)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_seconds = lease_seconds, renew_seconds
        self.renew_deadline = renew_deadline
        self.request_timeout = request_timeout or renew_seconds
        self.monotonic, self.wall, self.on_change = monotonic, wall, on_change
        self._lock = threading.Lock()
        self._leading_until = 0.0  # monotonic; leading while now < this
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0  # monotonic time this replica saw the record change
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._delivered: LeaderState | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._pending = False
        self._capped_claim: tuple[str | None, int] | None = None  # the last one logged

    @property
    def max_peer_lease_seconds(self) -> int:
        """The most a holder's Lease may claim: ``MAX_PEER_LEASE_FACTOR * lease_seconds``."""
        return MAX_PEER_LEASE_FACTOR * self.lease_seconds

    @classmethod
    def from_config(cls, config: KubernetesCoordinationConfig, **options: Any) -> LeaseElector:
        return cls(coordination_api_client(config.api_server), config.namespace,
                   config.lease_name, config.identity or default_identity(),
                   lease_seconds=config.lease_seconds, renew_seconds=config.renew_seconds,
                   renew_deadline=config.renew_deadline, **options)

    # -- what the loop reads -------------------------------------------------------------

    def is_leader(self) -> bool:
        with self._lock:
            return not self._stop.is_set() and self.monotonic() < self._leading_until

    def state(self) -> LeaderState:
        leading = self.is_leader()
        with self._lock:
            holder = self._observed.holder if self._observed is not None else None
            error = self._last_error
        return LeaderState(self.identity, leading, holder, f"{self.namespace}/{self.name}",
                           error)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("elector already started")
        if loop is None:
            with contextlib.suppress(RuntimeError):  # no loop: nobody to hand changes to
                loop = asyncio.get_running_loop()
        self._loop = loop
        LEADER.labels(identity=self.identity).set(0)
        self._thread = threading.Thread(target=self._run, name=f"lease-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, release: bool = True, timeout: float = 5.0) -> None:
        """Stop leading at once, end the thread, then (``release``) hand the Lease back."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("Lease thread did not stop within %.1fs", timeout)
        if release:
            try:
                self.release()
            except API_ERRORS as exc:
                log.warning("could not release Lease %s/%s: %s", self.namespace, self.name,
                            describe_error(exc))
        LEADER.labels(identity=self.identity).set(0)

    async def aclose(self, release: bool = True) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        await asyncio.to_thread(self.stop, release)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self.monotonic()
            self.step()
            self._stop.wait(max(0.0, self.renew_seconds - (self.monotonic() - started)))

    # -- one attempt ---------------------------------------------------------------------

    def step(self) -> bool:
        """One acquire-or-renew attempt; True if this replica holds the Lease now."""
        started = self.monotonic()
        try:
            held = self._try_acquire_or_renew()
            error = None
        except API_ERRORS as exc:
            held, error = False, describe_error(exc)
        with self._lock:
            if held and not self._stop.is_set():
                self._leading_until = started + self.renew_deadline
            if error is not None and error != self._last_error:
                log.warning("Lease %s/%s: %s", self.namespace, self.name, error)
            self._last_error = error
        self._hand_over()
        return held

    def _try_acquire_or_renew(self) -> bool:
        now = micro_time(self.wall())
        try:
            lease = self._read()
        except ApiException as exc:
            if exc.status != HTTP_NOT_FOUND:
                raise
            return self._create(now)
        record = self._observe(lease)
        if record.holder is not None and record.holder != self.identity:
            with self._lock:
                self._leading_until = 0.0  # someone else holds it: not us, from now on
            if self._observed_at + self._peer_duration(record) > self.monotonic():
                return False  # held, and not expired as we measure it
        ours = record.holder == self.identity
        spec = {**(lease.get("spec") or {}),
                "holderIdentity": self.identity, "leaseDurationSeconds": self.lease_seconds,
                "acquireTime": record.acquire_time if ours and record.acquire_time else now,
                "renewTime": now,
                "leaseTransitions": record.transitions + (0 if ours else 1)}
        return self._replace(lease, spec)

    def _peer_duration(self, record: LeaseRecord) -> int:
        """How long another holder's Lease lasts unchanged: its claim (our own duration when
        it claims none), at most :attr:`max_peer_lease_seconds` (logged once per claim)."""
        claimed = record.duration_s or self.lease_seconds
        cap = self.max_peer_lease_seconds
        if claimed <= cap:
            return claimed
        if self._capped_claim != (record.holder, claimed):
            self._capped_claim = (record.holder, claimed)
            log.warning("Lease %s/%s: holder %s claims leaseDurationSeconds %d; counting at "
                        "most %d (%d x our lease_seconds %d): taken over once unchanged that "
                        "long", self.namespace, self.name, shown_holder(record.holder),
                        claimed, cap, MAX_PEER_LEASE_FACTOR, self.lease_seconds)
        return cap

    def _create(self, now: str) -> bool:
        body = {"apiVersion": LEASE_API_VERSION, "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": self.lease_seconds,
                         "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
        try:
            created = self._call(self._api.create_namespaced_lease, self.namespace, body)
        except ApiException as exc:
            if exc.status == HTTP_CONFLICT:  # AlreadyExists: another replica was first
                return False
            raise
        self._observe(created)
        return True

    def _replace(self, lease: dict[str, Any], spec: dict[str, Any]) -> bool:
        body = {**lease, "spec": spec}  # metadata (resourceVersion included) as read
        try:
            replaced = self._call(self._api.replace_namespaced_lease, self.name,
                                  self.namespace, body)
        except ApiException as exc:
            if exc.status == HTTP_CONFLICT:  # another replica wrote first: re-read next time
                return False
            raise
        self._observe(replaced)
        return True

    def _read(self) -> dict[str, Any]:
        return self._call(self._api.read_namespaced_lease, self.name, self.namespace)

    def _call(self, method: Callable[..., Any], *args: Any) -> dict[str, Any]:
        response = method(*args, _preload_content=False,
                          _request_timeout=(self.request_timeout, self.request_timeout))
        body = json.loads(response.data)
        if not isinstance(body, dict):
            raise ValueError("the API answered a Lease request with a non-object")
        return body

    def _observe(self, lease: dict[str, Any]) -> LeaseRecord:
        record = LeaseRecord.of(lease)
        with self._lock:
            if record != self._observed:
                self._observed, self._observed_at = record, self.monotonic()
        return record

    def release(self) -> bool:
        """Give the Lease up if this replica holds it (never one another replica holds)."""
        with self._lock:
            self._leading_until = 0.0
        lease = self._read()
        record = LeaseRecord.of(lease)
        if record.holder != self.identity:
            return False
        now = micro_time(self.wall())
        spec = {**(lease.get("spec") or {}), "holderIdentity": None, "leaseDurationSeconds": 1,
                "acquireTime": now, "renewTime": now}
        released = self._replace(lease, spec)
        if released:
            log.info("released Lease %s/%s", self.namespace, self.name)
        return released

    # -- handing state changes to the loop ---------------------------------------------------

    def _hand_over(self) -> None:
        loop = self._loop
        if loop is None:
            return
        with self._lock:
            schedule, self._pending = not self._pending, True
        if schedule:
            try:
                loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed
                self._stop.set()

    def _deliver(self) -> None:
        """On the loop: log and export a change of leadership or holder. While leading, a
        timer fires at the deadline, so a thread stuck in a request still flips the metric."""
        with self._lock:
            self._pending = False
            until = self._leading_until
        state = self.state()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if state.leading and self._loop is not None:
            self._expiry = self._loop.call_at(
                self._loop.time() + max(0.0, until - self.monotonic()) + 0.001, self._deliver)
        previous, self._delivered = self._delivered, state
        if previous is not None and (previous.leading, previous.holder) == (state.leading,
                                                                            state.holder):
            return
        LEADER.labels(identity=self.identity).set(int(state.leading))
        if state.leading and not (previous and previous.leading):
            log.info("leading: %s holds Lease %s", self.identity, state.lease)
        elif previous is not None and previous.leading and not state.leading:
            log.warning("stopped leading (Lease %s; holder now %s%s)", state.lease,
                        shown_holder(state.holder),
                        f"; last error: {state.last_error}" if state.last_error else "")
        elif not state.leading:
            log.info("following: Lease %s held by %s", state.lease, shown_holder(state.holder))
        if self.on_change is not None:
            try:
                self.on_change(state)
            except Exception:
                log.exception("leader on_change callback failed")
