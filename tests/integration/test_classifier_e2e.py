"""Intent tiers end to end: ``trimtab serve`` + ``trimtab classify`` (ext_proc) + a real Envoy.

Requests of a pool with ``intent_tiers`` take the classifier hop and land on the tier's pool;
requests of other pools never take it; a classifier that hangs (SIGSTOP: every message times
out) or is gone costs a request its tier, never the request, and Envoy counts each case.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import INTENT_ROLES, TrimtabProcess, intent_tier_config
from tests.support import BackendFleet
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap

pytestmark = pytest.mark.slow

SETTLE_S = 15.0
TIMEOUT_MS = 50
ROLES = INTENT_ROLES
RULES = [{"tier": "code", "keywords": ["python"], "patterns": [r"\bdef \w+\("]}]


@dataclass
class Classify:
    """``python -m xds_server.classify`` as a child process, stopped by PID."""

    config_path: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "xds_server.classify", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)


@dataclass
class Stack:
    fleet: BackendFleet
    trimtab: TrimtabProcess
    classify: Classify
    envoy: EnvoyProcess
    port: int

    def role_of(self, address: str) -> str:
        return ROLES[self.fleet.addresses.index(address)]

    def hop_stat(self, name: str) -> int:
        """An ext_proc counter of the listener (summed over its name variants)."""
        text = self.envoy.admin_get("/stats?filter=ext_proc")
        return sum(int(v) for k, v in re.findall(r"^(\S*ext_proc\S*\." + name + r"): (\d+)$",
                                                 text, re.M))


def build_config(fleet: BackendFleet, ports: dict[str, int]) -> dict[str, Any]:
    return intent_tier_config(fleet, ports, embedded=False,  # this test runs `trimtab classify`
                              message_timeout_ms=TIMEOUT_MS, rules=RULES)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("classifier")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin",
                                            "classifier")}
    fleet = BackendFleet(len(ROLES)).start()
    config_path = workdir / "trimtab.yaml"
    config_path.write_text(yaml.safe_dump(build_config(fleet, ports), sort_keys=False))
    trimtab = TrimtabProcess(config_path, ports["admin"], workdir / "trimtab.log")
    classify = Classify(config_path, workdir / "classify.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
    stack = Stack(fleet, trimtab, classify, envoy, ports["listener"])
    try:
        classify.start()
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api="delta"),
                    workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        wait_until(lambda: _lands(stack, "m-intent", "python please"), SETTLE_S,
                   "the classifier answering", check=lambda role: role == "intent-code",
                   every=0.1)
        yield stack
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc, classify.proc) if p is not None]
        envoy.stop()
        trimtab.stop()
        classify.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


def _lands(stack: Stack, model: str, text: str, headers: dict[str, str] | None = None) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    try:
        body = {"model": model, "messages": [{"role": "system", "content": "python"},
                                             {"role": "user", "content": text}]}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, (resp.status, raw[:300])
    return stack.role_of(json.loads(raw)["backend"])


def test_a_classified_request_lands_on_its_tier(stack: Stack) -> None:
    assert _lands(stack, "m-intent", "write me some Python") == "intent-code"
    assert _lands(stack, "m-intent", "what does def main(argv): do?") == "intent-code"
    parts = [{"type": "text", "text": "fix this python"}]
    assert _lands(stack, "m-intent", parts) == "intent-code"  # type: ignore[arg-type]


def test_an_unclassified_or_forged_request_never_reaches_the_tier(stack: Stack) -> None:
    errors = {name: stack.hop_stat(name) for name in ("failure_mode_allowed", "streams_failed",
                                                      "spurious_msgs_received")}
    assert _lands(stack, "m-intent", "hello there") == "intent"  # the system prompt says python
    # a client cannot pick the tier: routes match the classifier's metadata, not the header
    assert _lands(stack, "m-intent", "hello", {"x-trimtab-tier": "code"}) == "intent"
    # "no tier" is an answer Envoy accepts, not a failure it forgives
    assert {name: stack.hop_stat(name) for name in errors} == errors


def test_only_pools_with_tiers_take_the_hop(stack: Stack) -> None:
    before = stack.hop_stat("streams_started")
    for _ in range(5):
        assert _lands(stack, "m-plain", "python") == "plain"
    assert stack.hop_stat("streams_started") == before
    _lands(stack, "m-intent", "python")
    assert stack.hop_stat("streams_started") == before + 1


def test_a_hanging_or_dead_classifier_fails_open(stack: Stack) -> None:
    proc = stack.classify.proc
    assert proc is not None
    timeouts = stack.hop_stat("message_timeouts")
    os.kill(proc.pid, signal.SIGSTOP)  # every message now times out
    try:
        for _ in range(5):
            assert _lands(stack, "m-intent", "python") == "intent"  # default tier, no failure
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert stack.hop_stat("message_timeouts") >= timeouts + 5
    wait_until(lambda: _lands(stack, "m-intent", "python"), SETTLE_S, "the tier back",
               check=lambda role: role == "intent-code", every=0.1)

    allowed = stack.hop_stat("failure_mode_allowed")
    stack.classify.stop()  # an outage: connections refused
    try:
        for _ in range(5):
            assert _lands(stack, "m-intent", "python") == "intent"
        assert stack.hop_stat("failure_mode_allowed") >= allowed + 5
    finally:
        stack.classify.start()
    wait_until(lambda: _lands(stack, "m-intent", "python"), SETTLE_S, "the classifier back",
               check=lambda role: role == "intent-code", every=0.2)
