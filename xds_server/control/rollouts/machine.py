"""Canary rollouts: a pure state machine, SLO gates, and an atomically written state file.

`advance(state, policy, stable, canary, now)` is pure: telemetry summaries in, the next state
out. Every step, rollback and promotion is an event in the state's history, so the controller
logs it and exports it as a metric. The history keeps the last `HISTORY_LIMIT` events; `seq`
counts every event ever recorded, so the controller finds the new ones even once the history
is full (`new_events`). The state file lets a restart resume at the same step; a
corrupt file is refused with a clear error rather than silently dropping a rollout.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from xds_server.config.pools import GateConfig, RolloutConfig

PROGRESSING = "progressing"
PAUSED = "paused"
PROMOTED = "promoted"
ROLLED_BACK = "rolled_back"
ABORTED = "aborted"
PHASES = (PROGRESSING, PAUSED, PROMOTED, ROLLED_BACK, ABORTED)
HISTORY_LIMIT = 50
STATE_FILE_VERSION = 1


class RolloutCommandError(ValueError):
    """An operator command that does not apply in the rollout's current phase."""


class RolloutStateError(ValueError):
    """A state file that cannot be trusted (unreadable, corrupt, or of an unknown version)."""


@dataclass(frozen=True)
class RolloutEvent:
    at: float
    kind: str  # start | step | rollback | promote | pause | resume | abort
    percent: float
    reason: str = ""


@dataclass(frozen=True)
class RolloutState:
    pool: str
    phase: str
    percent: float
    step: int
    step_started_at: float
    reason: str = ""
    history: tuple[RolloutEvent, ...] = field(default_factory=tuple)
    seq: int = 0  # events recorded so far, history's dropped ones included

    def with_event(self, event: RolloutEvent, **changes: Any) -> RolloutState:
        history = (*self.history, event)[-HISTORY_LIMIT:]
        return replace(self, history=history, reason=event.reason, seq=self.seq + 1, **changes)


def new_events(old: RolloutState | None, new: RolloutState) -> tuple[RolloutEvent, ...]:
    """The events `new` recorded since `old` (all of its history when there is no `old`, or
    when `new` is not a successor of it: a state file rewritten from scratch)."""
    if old is None or new.seq < old.seq:
        return new.history
    count = min(new.seq - old.seq, len(new.history))
    return new.history[len(new.history) - count:]


@dataclass(frozen=True)
class VersionStats:
    """One version's telemetry over the current step window. ``requests`` counts every
    request answered, finished or failed: the error rate's denominator."""

    requests: float
    errors: float = 0.0
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests > 0 else 0.0


def start(pool: str, policy: RolloutConfig, now: float) -> RolloutState:
    state = RolloutState(pool, PROGRESSING, policy.start_percent, 0, now)
    return state.with_event(RolloutEvent(now, "start", policy.start_percent, "rollout started"))


def _relative_breach(name: str, stable: float | None, canary: float | None,
                     tolerance: float) -> str | None:
    if stable is None or canary is None or stable <= 0:
        return None
    if canary > stable * (1 + tolerance):
        return (f"{name} canary {canary * 1000:.1f} ms > stable {stable * 1000:.1f} ms "
                f"× {1 + tolerance:.2f}")
    return None


def gate_breach(stable: VersionStats, canary: VersionStats, gates: GateConfig) -> str | None:
    """The reason the canary fails its SLO gates, or None (passing, or too little data)."""
    if canary.requests < gates.min_requests or stable.requests < gates.min_requests:
        return None
    if canary.error_rate > stable.error_rate + gates.error_rate_tolerance:
        return (f"error rate canary {canary.error_rate:.2%} > stable {stable.error_rate:.2%} "
                f"+ {gates.error_rate_tolerance:.2%}")
    return (_relative_breach("P95 TTFT", stable.ttft_p95_s, canary.ttft_p95_s,
                             gates.ttft_p95_tolerance)
            or _relative_breach("P95 ITL", stable.itl_p95_s, canary.itl_p95_s,
                                gates.itl_p95_tolerance))


def advance(state: RolloutState, policy: RolloutConfig, stable: VersionStats,
            canary: VersionStats, now: float) -> RolloutState:
    """One tick of a rollout: roll back on a breach, step after the interval, promote at the
    end. A step needs `gates.min_requests` on both versions, so an idle canary never advances."""
    if state.phase != PROGRESSING:
        return state
    breach = gate_breach(stable, canary, policy.gates)
    if breach is not None:
        return state.with_event(RolloutEvent(now, "rollback", 0.0, breach),
                                phase=ROLLED_BACK, percent=0.0)
    if now - state.step_started_at < policy.step_interval_seconds:
        return state
    if canary.requests < policy.gates.min_requests:
        return state
    if state.percent >= policy.max_percent:
        reason = f"passed every gate through {state.percent:g}%"
        return state.with_event(RolloutEvent(now, "promote", 100.0, reason),
                                phase=PROMOTED, percent=100.0)
    percent = min(state.percent + policy.step_percent, policy.max_percent)
    reason = f"gates passed at {state.percent:g}%, stepping to {percent:g}%"
    return state.with_event(RolloutEvent(now, "step", percent, reason),
                            percent=percent, step=state.step + 1, step_started_at=now)


def command(state: RolloutState, action: str, policy: RolloutConfig, now: float) -> RolloutState:
    """Operator controls: pause, resume, promote, abort."""
    if action == "pause":
        if state.phase != PROGRESSING:
            raise RolloutCommandError(f"cannot pause a rollout that is {state.phase}")
        return state.with_event(RolloutEvent(now, "pause", state.percent, "paused by operator"),
                                phase=PAUSED)
    if action == "resume":
        if state.phase == PAUSED:
            return state.with_event(RolloutEvent(now, "resume", state.percent, "resumed"),
                                    phase=PROGRESSING, step_started_at=now)
        if state.phase in (ROLLED_BACK, ABORTED):
            return state.with_event(RolloutEvent(now, "resume", policy.start_percent,
                                                 "restarted by operator"),
                                    phase=PROGRESSING, percent=policy.start_percent, step=0,
                                    step_started_at=now)
        raise RolloutCommandError(f"cannot resume a rollout that is {state.phase}")
    if action == "promote":
        if state.phase == PROMOTED:
            raise RolloutCommandError("the rollout is already promoted")
        return state.with_event(RolloutEvent(now, "promote", 100.0, "promoted by operator"),
                                phase=PROMOTED, percent=100.0)
    if action == "abort":
        if state.phase in (ABORTED, PROMOTED):
            raise RolloutCommandError(f"cannot abort a rollout that is {state.phase}")
        return state.with_event(RolloutEvent(now, "abort", 0.0, "aborted by operator"),
                                phase=ABORTED, percent=0.0)
    raise RolloutCommandError(f"unknown action {action!r}; expected pause, resume, promote "
                              f"or abort")


def to_json(states: Mapping[str, RolloutState]) -> str:
    body = {"version": STATE_FILE_VERSION,
            "rollouts": {pool: asdict(state) for pool, state in sorted(states.items())}}
    return json.dumps(body, indent=1, sort_keys=True)


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _percent(value: Any) -> bool:
    return _finite(value) and 0 <= value <= 100


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str)


Check = tuple[Callable[[Any], bool], str]
_STATE_FIELDS: dict[str, Check] = {
    "pool": (lambda v: isinstance(v, str) and v != "", "a pool name"),
    "phase": (lambda v: isinstance(v, str) and v in PHASES, f"one of {', '.join(PHASES)}"),
    "percent": (_percent, "a finite number in 0..100"),
    "step": (_count, "an integer >= 0"),
    "step_started_at": (_finite, "a finite number (UNIX seconds)"),
    "reason": (_text, "a string"),
    "seq": (_count, "an integer >= 0"),
}
_EVENT_FIELDS: dict[str, Check] = {
    "at": (_finite, "a finite number (UNIX seconds)"),
    "kind": (lambda v: isinstance(v, str) and v != "", "an event kind"),
    "percent": (_percent, "a finite number in 0..100"),
    "reason": (_text, "a string"),
}


def _check_fields(path: str, raw: Any, fields: Mapping[str, Check], required: tuple[str, ...],
                  nested: frozenset[str] = frozenset()) -> None:
    if not isinstance(raw, dict):
        raise RolloutStateError(f"{path}: expected an object, got {type(raw).__name__}")
    unknown = sorted(raw.keys() - fields.keys() - nested)
    if unknown:
        raise RolloutStateError(f"{path}.{unknown[0]}: unknown key")
    for key in required:
        if key not in raw:
            raise RolloutStateError(f"{path}.{key}: missing")
    for key, (ok, expected) in fields.items():
        if key in raw and not ok(raw[key]):
            raise RolloutStateError(f"{path}.{key}: expected {expected}, got {raw[key]!r}")


def _event_from(path: str, raw: Any) -> RolloutEvent:
    _check_fields(path, raw, _EVENT_FIELDS, ("at", "kind", "percent"))
    return RolloutEvent(float(raw["at"]), raw["kind"], float(raw["percent"]),
                        raw.get("reason", ""))


def _state_from(pool: str, raw: Any) -> RolloutState:
    """One pool's state, every field checked: a bad file is refused, never half-loaded."""
    path = f"rollouts.{pool}"
    _check_fields(path, raw, _STATE_FIELDS, ("pool", "phase", "percent", "step",
                                             "step_started_at"), frozenset({"history"}))
    if raw["pool"] != pool:
        raise RolloutStateError(f"{path}.pool: expected {pool!r}, got {raw['pool']!r}")
    events = raw.get("history", [])
    if not isinstance(events, list):
        raise RolloutStateError(f"{path}.history: expected a list, got {type(events).__name__}")
    history = tuple(_event_from(f"{path}.history[{i}]", e) for i, e in enumerate(events))
    seq = raw.get("seq", len(history))  # files from before `seq`: the history is every event
    if seq < len(history):
        raise RolloutStateError(f"{path}.seq: {seq} is below the {len(history)} events in "
                                f"history")
    return RolloutState(pool, raw["phase"], float(raw["percent"]), raw["step"],
                        float(raw["step_started_at"]), raw.get("reason", ""), history, seq)


def from_json(text: str) -> dict[str, RolloutState]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RolloutStateError(f"not valid JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("version") != STATE_FILE_VERSION:
        raise RolloutStateError(f"expected {{\"version\": {STATE_FILE_VERSION}, "
                                f"\"rollouts\": ...}}")
    rollouts = body.get("rollouts")
    if not isinstance(rollouts, dict):
        raise RolloutStateError("`rollouts` must be an object")
    return {pool: _state_from(pool, raw) for pool, raw in rollouts.items()}


def load_state(path: Path) -> dict[str, RolloutState]:
    """Read the state file; a missing file is an empty state, a corrupt one an error."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise RolloutStateError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return from_json(text)
    except RolloutStateError as exc:
        raise RolloutStateError(f"{path}: {exc} (fix or remove the file; trimtab will not "
                                f"guess a rollout's state)") from None


def save_state(path: Path, states: Mapping[str, RolloutState]) -> None:
    """Write atomically: a temp file in the same directory, fsync, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(to_json(states))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
