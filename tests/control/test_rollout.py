"""Canary rollout state machine, gates and the state file."""

from __future__ import annotations

import json
from typing import Any

import pytest

from xds_server.config.pools import GateConfig, RolloutConfig
from xds_server.control.rollouts.machine import (
    ABORTED,
    HISTORY_LIMIT,
    PAUSED,
    PROGRESSING,
    PROMOTED,
    ROLLED_BACK,
    RolloutCommandError,
    RolloutStateError,
    VersionStats,
    advance,
    command,
    from_json,
    gate_breach,
    load_state,
    new_events,
    save_state,
    start,
    to_json,
)

POLICY = RolloutConfig(start_percent=10, step_percent=5, step_interval_seconds=300, max_percent=20)
GOOD = VersionStats(requests=100, errors=0, ttft_p95_s=0.5, itl_p95_s=0.02)


def test_default_schedule_is_the_seeds():
    default = RolloutConfig()
    assert (default.start_percent, default.step_percent, default.step_interval_seconds) == (10, 5, 300)


def test_steps_after_interval_then_promotes():
    s = start("p", POLICY, 0.0)
    assert (s.phase, s.percent) == (PROGRESSING, 10)
    assert advance(s, POLICY, GOOD, GOOD, 299.0) == s
    s = advance(s, POLICY, GOOD, GOOD, 300.0)
    assert (s.percent, s.step) == (15, 1)
    s = advance(s, POLICY, GOOD, GOOD, 600.0)
    assert s.percent == 20
    s = advance(s, POLICY, GOOD, GOOD, 900.0)
    assert (s.phase, s.percent) == (PROMOTED, 100)
    assert [e.kind for e in s.history] == ["start", "step", "step", "promote"]


def test_breach_rolls_back_to_zero_with_reason():
    s = start("p", POLICY, 0.0)
    slow = VersionStats(requests=100, ttft_p95_s=0.9, itl_p95_s=0.02)
    s = advance(s, POLICY, GOOD, slow, 10.0)
    assert (s.phase, s.percent) == (ROLLED_BACK, 0)
    assert "TTFT" in s.reason and s.history[-1].kind == "rollback"
    assert advance(s, POLICY, GOOD, GOOD, 1000.0) == s  # stays rolled back


def test_error_rate_gate_is_absolute_and_needs_enough_requests():
    gates = GateConfig(error_rate_tolerance=0.01, min_requests=20)
    failing = VersionStats(requests=100, errors=5)
    assert "error rate" in (gate_breach(GOOD, failing, gates) or "")
    assert gate_breach(GOOD, VersionStats(requests=5, errors=5), gates) is None
    assert gate_breach(GOOD, VersionStats(requests=100, errors=1), gates) is None


def test_idle_canary_never_advances():
    s = start("p", POLICY, 0.0)
    assert advance(s, POLICY, GOOD, VersionStats(requests=0), 10_000.0).percent == 10


def test_operator_commands_and_invalid_transitions():
    s = start("p", POLICY, 0.0)
    paused = command(s, "pause", POLICY, 1.0)
    assert paused.phase == PAUSED and advance(paused, POLICY, GOOD, GOOD, 9999.0) == paused
    with pytest.raises(RolloutCommandError):
        command(paused, "pause", POLICY, 2.0)
    resumed = command(paused, "resume", POLICY, 3.0)
    assert resumed.phase == PROGRESSING and resumed.step_started_at == 3.0
    aborted = command(resumed, "abort", POLICY, 4.0)
    assert (aborted.phase, aborted.percent) == (ABORTED, 0)
    restarted = command(aborted, "resume", POLICY, 5.0)
    assert (restarted.phase, restarted.percent) == (PROGRESSING, 10)
    assert command(restarted, "promote", POLICY, 6.0).percent == 100
    with pytest.raises(RolloutCommandError, match="unknown action"):
        command(s, "explode", POLICY, 7.0)


def test_state_file_round_trip_is_atomic_and_resumes(tmp_path):
    path = tmp_path / "state" / "rollouts.json"
    s = advance(start("p", POLICY, 0.0), POLICY, GOOD, GOOD, 300.0)
    save_state(path, {"p": s})
    assert load_state(path) == {"p": s}
    assert [p.name for p in path.parent.iterdir()] == ["rollouts.json"]  # no temp files left
    assert from_json(to_json({"p": s}))["p"].percent == 15


def test_missing_state_file_is_empty_but_corrupt_is_refused(tmp_path):
    assert load_state(tmp_path / "nope.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RolloutStateError, match="bad.json: not valid JSON"):
        load_state(bad)
    bad.write_text('{"version": 1, "rollouts": {"p": {"pool": "p", "phase": "dancing", '
                   '"percent": 5, "step": 0, "step_started_at": 0}}}')
    with pytest.raises(RolloutStateError, match="rollouts.p.phase: expected one of progressing"):
        load_state(bad)
    bad.write_text('{"version": 99}')
    with pytest.raises(RolloutStateError, match="version"):
        load_state(bad)


def _long_schedule(events: int) -> list:
    """States after each of `events` events: start, then pause/resume pairs."""
    states = [start("p", POLICY, 0.0)]
    while len(states) < events:
        action = "pause" if states[-1].phase == PROGRESSING else "resume"
        states.append(command(states[-1], action, POLICY, float(len(states))))
    return states


def test_history_is_capped_but_seq_counts_every_event():
    states = _long_schedule(2 * HISTORY_LIMIT + 3)
    last = states[-1]
    assert len(last.history) == HISTORY_LIMIT and last.seq == 2 * HISTORY_LIMIT + 3
    assert [s.seq for s in states] == list(range(1, len(states) + 1))
    assert new_events(None, states[0]) == states[0].history


def test_new_events_past_the_cap_are_exactly_the_new_ones():
    states = _long_schedule(HISTORY_LIMIT + 10)
    old, new = states[HISTORY_LIMIT + 2], states[HISTORY_LIMIT + 5]
    assert len(old.history) == len(new.history) == HISTORY_LIMIT  # the old way found nothing
    fresh = new_events(old, new)
    assert fresh == tuple(s.history[-1] for s in states[HISTORY_LIMIT + 3:HISTORY_LIMIT + 6])
    assert new_events(new, new) == ()
    restarted = start("p", POLICY, 99.0)  # a state file rewritten from scratch
    assert new_events(new, restarted) == restarted.history


def test_state_file_keeps_seq_and_accepts_files_from_before_it(tmp_path):
    last = _long_schedule(HISTORY_LIMIT + 4)[-1]
    assert from_json(to_json({"p": last}))["p"].seq == HISTORY_LIMIT + 4
    body = json.loads(to_json({"p": last}))
    del body["rollouts"]["p"]["seq"]
    assert from_json(json.dumps(body))["p"].seq == HISTORY_LIMIT


def _state_text(**changes: Any) -> str:
    good: dict[str, Any] = {"pool": "p", "phase": "progressing", "percent": 15.0, "step": 1,
                            "step_started_at": 300.0, "reason": "",
                            "history": [{"at": 0.0, "kind": "start", "percent": 10.0,
                                         "reason": "rollout started"}]}
    for key, value in changes.items():
        if value is _DROP:
            good.pop(key)
        else:
            good[key] = value
    return json.dumps({"version": 1, "rollouts": {"p": good}})


_DROP = object()
CORRUPT = {
    "percent-string": ({"percent": "15"}, "rollouts.p.percent: expected a finite number in "
                                          "0..100, got '15'"),
    "percent-null": ({"percent": None}, "rollouts.p.percent: expected a finite number in "
                                        "0..100, got None"),
    "percent-nan": ({"percent": float("nan")}, "rollouts.p.percent: .* got nan"),
    "percent-infinite": ({"percent": float("inf")}, "rollouts.p.percent: .* got inf"),
    "percent-above-100": ({"percent": 150}, "rollouts.p.percent: .* got 150"),
    "percent-bool": ({"percent": True}, "rollouts.p.percent: .* got True"),
    "step-string": ({"step": "1"}, "rollouts.p.step: expected an integer >= 0, got '1'"),
    "step-negative": ({"step": -1}, "rollouts.p.step: expected an integer >= 0, got -1"),
    "step-float": ({"step": 1.5}, "rollouts.p.step: expected an integer >= 0, got 1.5"),
    "step-null": ({"step": None}, "rollouts.p.step: expected an integer >= 0, got None"),
    "started-string": ({"step_started_at": "yesterday"},
                       "rollouts.p.step_started_at: expected a finite number .* 'yesterday'"),
    "started-infinite": ({"step_started_at": float("inf")},
                         "rollouts.p.step_started_at: expected a finite number .* got inf"),
    "started-huge-int": ({"step_started_at": 10**400}, "rollouts.p.step_started_at: expected"),
    "started-missing": ({"step_started_at": _DROP}, "rollouts.p.step_started_at: missing"),
    "phase-null": ({"phase": None}, "rollouts.p.phase: expected one of"),
    "reason-number": ({"reason": 3}, "rollouts.p.reason: expected a string, got 3"),
    "unknown-key": ({"colour": "blue"}, "rollouts.p.colour: unknown key"),
    "other-pool": ({"pool": "q"}, "rollouts.p.pool: expected 'p', got 'q'"),
    "history-object": ({"history": {}}, "rollouts.p.history: expected a list, got dict"),
    "event-not-object": ({"history": [3]}, r"rollouts.p.history\[0\]: expected an object"),
    "event-percent-string": ({"history": [{"at": 0, "kind": "start", "percent": "x"}]},
                             r"rollouts.p.history\[0\].percent: expected a finite number"),
    "event-at-missing": ({"history": [{"kind": "start", "percent": 10}]},
                         r"rollouts.p.history\[0\].at: missing"),
    "seq-below-history": ({"seq": 0}, "rollouts.p.seq: 0 is below the 1 events in history"),
    "seq-negative": ({"seq": -4}, "rollouts.p.seq: expected an integer >= 0, got -4"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_state_fields_are_refused_with_the_field_named(case, tmp_path):
    changes, message = CORRUPT[case]
    path = tmp_path / "rollouts.json"
    path.write_text(_state_text(**changes))
    with pytest.raises(RolloutStateError, match=message) as exc:
        load_state(path)
    assert str(path) in str(exc.value) and "fix or remove the file" in str(exc.value)


def test_a_valid_state_text_loads():  # the base of CORRUPT is good: each case breaks one field
    state = from_json(_state_text())["p"]
    assert (state.percent, state.step, state.step_started_at, state.seq) == (15.0, 1, 300.0, 1)
    assert from_json(_state_text(percent=20, step_started_at=5))["p"].percent == 20.0
