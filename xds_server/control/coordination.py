"""N replicas on Kubernetes: the Lease holder drives the rollouts, everyone routes by them.

:class:`CoordinatedRollouts` replaces ``rollouts.drive`` when ``coordination.kubernetes`` is
configured. Every tick, every replica reads the rollout state from the store (a ConfigMap)
and routes by it, so a follower follows a change within one tick. Only the replica whose
:class:`~xds_server.control.leader.LeaseElector` says it leads advances a rollout or accepts an
operator command, and then only as read-decide-write over the version it read: a 409 (someone
wrote in between) re-reads and decides again from what is stored, so an abort written just
before is never overwritten and a step is never taken twice. Events are logged and counted
by the replica whose write committed them, after the write, so each happens once across the
replicas; adopting a state another replica wrote is silent. The next leader resumes from the
stored state (same step, same ``step_started_at``), never from its own memory.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from xds_server.admin.metrics import ROLLOUT_PERCENT
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.control.leader import LeaderState, LeaseElector, coordination_api_client
from xds_server.control.rollouts import machine as rollout
from xds_server.control.rollouts.machine import RolloutCommandError, RolloutState, RolloutStateError
from xds_server.control.rollouts.runner import Rollouts, _addresses, _default_policy
from xds_server.control.rollouts.state import (
    ConfigMapStateStore,
    StateConflict,
    StateStore,
    StateStoreError,
    StoredState,
)
from xds_server.control.slo import SloTracker

log = logging.getLogger("trimtab.rollout")

ATTEMPTS = 3  # read-decide-write rounds before a tick or command gives up on conflicts


class Leader(Protocol):
    def is_leader(self) -> bool: ...

    def state(self) -> LeaderState: ...


def warn_deprecated_drive(config: Config) -> None:
    """`rollouts.drive` set by hand: deprecated; ignored when the Lease decides."""
    if "drive" not in config.rollouts.model_fields_set:
        return
    if config.coordination.kubernetes is not None:
        log.warning("rollouts.drive is deprecated and ignored: with coordination.kubernetes "
                    "the replica holding the Lease drives the rollouts")
    else:
        log.warning("rollouts.drive is deprecated: it stays as an override for embedded mode; "
                    "on Kubernetes configure coordination.kubernetes (Lease leader election) "
                    "instead")


def advance_pool(pool: PoolConfig, state: RolloutState | None, tracker: SloTracker,
                 now: float) -> RolloutState:
    """One tick of one pool's rollout from ``state`` (None: the rollout starts now)."""
    policy = pool.rollout or _default_policy()
    current = state or rollout.start(pool.name, policy, now)
    stable, canary = _addresses(pool)
    since = max(current.step_started_at, now - policy.step_interval_seconds)
    return rollout.advance(current, policy, tracker.stats(stable, since),
                           tracker.stats(canary, since), now)


class CoordinatedRollouts(Rollouts):
    """Rollouts whose state lives in ``store`` and whose driver is the Lease holder."""

    def __init__(self, config: Config, store: StateStore, leader: Leader,
                 read_budget_s: float | None = None) -> None:
        """``read_budget_s``: how long a tick waits for the state read (None: the store's
        own timeouts); past it the tick goes on with the last state read, and the read
        finishes in its thread without holding up the weights."""
        self.store, self.leader = store, leader
        self.read_budget_s = read_budget_s
        self._read_error: str | None = None
        self._loading: asyncio.Future[StoredState] | None = None
        super().__init__(config, None)

    # `drive` is the Lease's business here; the config's value is ignored
    @property  # type: ignore[override]
    def drive(self) -> bool:
        return self.leader.is_leader()

    @drive.setter
    def drive(self, value: bool) -> None:
        pass

    def refusal(self) -> str:
        state = self.leader.state()
        holder = state.holder if state.holder and state.holder != state.identity else None
        return (f"this replica ({state.identity}) does not lead the rollouts; "
                + (f"the leader is {holder}: send rollout commands to it" if holder else
                   "no replica leads right now (Lease not held or the API unreachable)"))

    def leader_document(self) -> dict[str, Any]:
        return {**self.leader.state().document(), "mode": "kubernetes",
                "state_error": self._read_error}

    # -- ticks -------------------------------------------------------------------------------

    async def atick(self, tracker: SloTracker, now: float) -> bool:
        stored = await self._load()
        if stored is None:
            return False
        for _ in range(ATTEMPTS):
            if not self.leader.is_leader():
                return self._adopt_all(stored.states)
            decided = {name: advance_pool(pool, stored.states.get(name), tracker, now)
                       for name, pool in self.pools.items()}
            if all(stored.states.get(name) == new for name, new in decided.items()):
                return self._adopt_all(stored.states)
            try:
                await asyncio.to_thread(self.store.save, {**stored.states, **decided},
                                        stored.version)
            except StateConflict as exc:
                log.info("rollout state changed since it was read (%s); re-reading", exc)
                stored = await self._load()
                if stored is None:
                    return False
                continue
            except StateStoreError as exc:
                log.error("rollout state not written, nothing advanced: %s", exc)
                return self._adopt_all(stored.states)
            return self._commit(stored.states, decided)
        log.warning("rollout state kept changing under this tick; deciding again next tick")
        return self._adopt_all(stored.states)

    def tick(self, tracker: SloTracker, now: float) -> bool:
        raise RuntimeError("CoordinatedRollouts does API I/O: call `await atick(...)`")

    async def _load(self) -> StoredState | None:
        if self._loading is None or self._loading.done():  # never two reads at once
            self._loading = asyncio.ensure_future(asyncio.to_thread(self.store.load))
        try:
            stored = await asyncio.wait_for(asyncio.shield(self._loading), self.read_budget_s)
        except TimeoutError:
            return self._unreadable(f"reading the rollout state took over "
                                    f"{self.read_budget_s:g}s")
        except (StateStoreError, RolloutStateError) as exc:
            return self._unreadable(str(exc))
        if self._read_error is not None:
            log.info("rollout state readable again")
        self._read_error = None
        return stored

    def _unreadable(self, error: str) -> StoredState | None:
        if error != self._read_error:
            log.error("cannot read the rollout state; routing by the last one read: %s", error)
        self._read_error = error
        return None

    def _commit(self, before: Mapping[str, RolloutState],
                decided: Mapping[str, RolloutState]) -> bool:
        """After a successful write: log and count what this replica's write recorded."""
        changed = False
        for name, new in decided.items():
            old = before.get(name)
            if old == new:
                changed |= self._adopt(name, new)
            else:
                changed |= self._store(name, old, new)
        return changed

    def _adopt(self, name: str, state: RolloutState) -> bool:
        """Take a state another replica wrote: route by it, announce nothing."""
        ROLLOUT_PERCENT.labels(pool=name).set(state.percent)
        self._gauged.setdefault(name, set())  # the series goes when the pool does
        changed = self.states.get(name) != state
        self.states[name] = state
        return changed

    def _adopt_all(self, states: Mapping[str, RolloutState]) -> bool:
        changed = False
        for name in self.pools:
            if name in states:
                changed |= self._adopt(name, states[name])
        return changed

    # -- operator commands ---------------------------------------------------------------------

    async def acommand(self, name: str, action: str, now: float) -> RolloutState:
        """Leader only: read, apply, write over what was read, then adopt. Raises KeyError,
        RolloutCommandError (does not apply, or this replica does not lead) or
        StateStoreError (nothing was changed)."""
        pool = self.pools[name]
        policy = pool.rollout or _default_policy()
        for _ in range(ATTEMPTS):
            try:
                stored = await asyncio.to_thread(self.store.load)
            except RolloutStateError as exc:
                raise StateStoreError(str(exc)) from None
            old = stored.states.get(name)
            new = rollout.command(old or rollout.start(name, policy, now), action, policy, now)
            if not self.leader.is_leader():
                raise RolloutCommandError(self.refusal())
            try:
                await asyncio.to_thread(self.store.save, {**stored.states, name: new},
                                        stored.version)
            except StateConflict:
                continue
            self._store(name, old, new)
            return new
        raise StateStoreError(f"the rollout state changed {ATTEMPTS} times while applying "
                              f"{action}; nothing was changed, try again")

    def command(self, name: str, action: str, now: float) -> RolloutState:
        raise RuntimeError("CoordinatedRollouts does API I/O: call `await acommand(...)`")

    def save(self) -> None:
        """Nothing to do: every change is written before it is applied."""


def kubernetes_rollouts(config: Config) -> tuple[CoordinatedRollouts, LeaseElector] | None:
    """The Lease elector and the ConfigMap-backed rollouts for ``coordination.kubernetes``."""
    k8s = config.coordination.kubernetes
    if k8s is None:
        return None
    elector = LeaseElector.from_config(k8s)
    store = ConfigMapStateStore(coordination_api_client(k8s.api_server), k8s.namespace,
                                k8s.state_configmap, elector.identity,
                                request_timeout=max(k8s.renew_seconds, 1.0))
    budget = config.telemetry.interval_seconds / 2  # a slow API never holds a tick up long
    return CoordinatedRollouts(config, store, elector, read_budget_s=budget), elector
