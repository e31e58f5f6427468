"""Runs the canary rollouts of every pool with `versions`: one `advance` per tick, operator
commands, the state file, logs and metrics. The state machine itself is in rollout.py."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from xds_server.admin.metrics import ROLLOUT_EVENTS, ROLLOUT_PERCENT
from xds_server.config.pools import PoolConfig
from xds_server.config.schema import Config
from xds_server.control.rollouts import machine as rollout
from xds_server.control.rollouts.machine import RolloutState
from xds_server.control.slo import SloTracker

log = logging.getLogger("trimtab.rollout")



class RolloutPersistError(RuntimeError):
    """The state file could not be written: the command was not applied."""


class Rollouts:
    def __init__(self, config: Config, state_file: Path | None) -> None:
        self.state_file = state_file
        self._unsaved = False  # a tick's change the state file does not hold yet
        self._gauged: dict[str, set[str]] = {}  # pool -> event kinds with a metric series
        self.drive = config.rollouts.drive
        self.states: dict[str, RolloutState] = (
            rollout.load_state(state_file) if state_file is not None else {})
        self.apply_config(config)

    def apply_config(self, config: Config) -> None:
        self.drive = config.rollouts.drive
        self.pools: dict[str, PoolConfig] = {
            pool.name: pool for pool in config.pools if pool.versions is not None}
        for name in [n for n in self.states if n not in self.pools]:
            log.info("rollout for %s dropped: the pool no longer has versions", name)
            del self.states[name]
        for name in [n for n in self._gauged if n not in self.pools]:
            ROLLOUT_PERCENT.remove(name)  # a pool gone leaves no series behind
            for kind in self._gauged.pop(name):
                ROLLOUT_EVENTS.remove(name, kind)

    def percents(self) -> dict[str, float]:
        return {name: self.states[name].percent for name in self.pools if name in self.states}

    def tick(self, tracker: SloTracker, now: float) -> bool:
        """Advance every rollout; returns True when any state changed (and was saved).
        A follower replica only re-reads the state the driving replica writes."""
        if not self.drive:
            return self._follow()
        changed = False
        for name, pool in self.pools.items():
            policy = pool.rollout or _default_policy()
            state = self.states.get(name) or rollout.start(name, policy, now)
            stable_addresses, canary_addresses = _addresses(pool)
            since = max(state.step_started_at, now - policy.step_interval_seconds)
            new = rollout.advance(state, policy, tracker.stats(stable_addresses, since),
                                  tracker.stats(canary_addresses, since), now)
            changed |= self._store(name, state if name in self.states else None, new)
        if changed or self._unsaved:
            try:
                self.save()
            except RolloutPersistError as exc:  # the rollout goes on; retried next tick
                self._unsaved = True
                log.error("rollout state not saved (retrying next tick): %s", exc)
        return changed

    def _follow(self) -> bool:
        if self.state_file is None:
            return False
        try:
            states = rollout.load_state(self.state_file)
        except rollout.RolloutStateError as exc:
            log.error("follower: keeping the last rollout state: %s", exc)
            return False
        changed = False
        for name in self.pools:
            if name in states:
                changed |= self._store(name, self.states.get(name), states[name])
        return changed

    def command(self, name: str, action: str, now: float) -> RolloutState:
        """Operator control: persisted first, then applied. Raises KeyError (unknown pool),
        RolloutCommandError, or RolloutPersistError (the state file cannot be written; then
        nothing changed, in memory or on disk)."""
        pool = self.pools[name]
        state = self.states.get(name) or rollout.start(name, pool.rollout or _default_policy(), now)
        new = rollout.command(state, action, pool.rollout or _default_policy(), now)
        self._save({**self.states, name: new})
        self._store(name, state, new)
        return new

    def _store(self, name: str, old: RolloutState | None, new: RolloutState) -> bool:
        ROLLOUT_PERCENT.labels(pool=name).set(new.percent)
        kinds = self._gauged.setdefault(name, set())
        if old is not None and old == new:
            return False
        for event in rollout.new_events(old, new):
            kinds.add(event.kind)
            ROLLOUT_EVENTS.labels(pool=name, kind=event.kind).inc()
            log.info("rollout %s: %s at %g%%: %s", name, event.kind, event.percent, event.reason)
        self.states[name] = new
        return True

    def save(self) -> None:
        self._save(self.states)
        self._unsaved = False

    def _save(self, states: Mapping[str, RolloutState]) -> None:
        if self.state_file is None:
            return
        try:
            rollout.save_state(self.state_file, states)
        except OSError as exc:
            raise RolloutPersistError(f"cannot write the rollout state file "
                                      f"{self.state_file}: {exc.strerror or exc}") from None

    # -- the interface the controller and the admin API use (coordination.py overrides) --

    async def atick(self, tracker: SloTracker, now: float) -> bool:
        return self.tick(tracker, now)

    async def acommand(self, name: str, action: str, now: float) -> RolloutState:
        return self.command(name, action, now)

    def refusal(self) -> str:
        """Why this replica refuses rollout commands (when it does not drive)."""
        return ("this replica follows the rollout state file (rollouts.drive: false); send "
                "commands to the driving one")

    def leader_document(self) -> dict[str, object]:
        return {"mode": "embedded", "leading": self.drive}

    def document(self) -> dict[str, object]:
        return {name: {"phase": s.phase, "percent": s.percent, "step": s.step,
                       "step_started_at": s.step_started_at, "reason": s.reason,
                       "history": [vars(e) for e in s.history[-20:]]}
                for name, s in sorted(self.states.items())}


def _default_policy() -> rollout.RolloutConfig:
    return rollout.RolloutConfig()


def _addresses(pool: PoolConfig) -> tuple[list[str], list[str]]:
    versions: Mapping[str, list[str]] = {
        version: [ep.address for ep in endpoints] for _, version, endpoints in pool.clusters()}
    return versions.get("stable", []), versions.get("canary", [])
