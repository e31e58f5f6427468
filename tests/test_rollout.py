"""Canary rollout state machine, gates and the state file."""

from __future__ import annotations

import pytest

from xds_server.config import GateConfig, RolloutConfig
from xds_server.rollout import (
    ABORTED,
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
    with pytest.raises(RolloutStateError, match="bad phase"):
        load_state(bad)
    bad.write_text('{"version": 99}')
    with pytest.raises(RolloutStateError, match="version"):
        load_state(bad)
