"""The classifier `trimtab serve` runs itself, end to end: ``trimtab serve`` (no `trimtab
classify`) + a real Envoy over ADS + fake backends.

A request the rules put in a tier lands on the tier's pool; a SIGHUP with new rules applies
them to the running classifier; with the classifier stopped (a reload to ``embedded: false``:
the cluster still points at it, nothing listens), hanging (SIGSTOPped: every message times
out) or killed (trimtab starts it again) the same request lands on the default pool, never
fails, and Envoy counts it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
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
ROLES = INTENT_ROLES


@dataclass
class Stack:
    fleet: BackendFleet
    trimtab: TrimtabProcess
    envoy: EnvoyProcess
    config_path: Path
    ports: dict[str, int]

    def role_of(self, address: str) -> str:
        return ROLES[self.fleet.addresses.index(address)]

    def hop_stat(self, name: str) -> int:
        text = self.envoy.admin_get("/stats?filter=ext_proc")
        return sum(int(v) for _, v in re.findall(r"^(\S*ext_proc\S*\." + name + r"): (\d+)$",
                                                 text, re.M))

    def lands(self, text: str, model: str = "m-intent") -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.ports["listener"], timeout=10)
        try:
            body = {"model": model, "messages": [{"role": "user", "content": text}]}
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        assert resp.status == 200, (resp.status, raw[:300])
        return self.role_of(json.loads(raw)["backend"])

    def reload(self, **classifier: Any) -> None:
        """Rewrite the config with these classifier keys and SIGHUP trimtab."""
        document = build_config(self.fleet, self.ports, **classifier)
        self.config_path.write_text(yaml.safe_dump(document, sort_keys=False))
        assert self.trimtab.proc is not None
        self.trimtab.proc.send_signal(signal.SIGHUP)

    def classifier_listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.ports["classifier"])) == 0


def build_config(fleet: BackendFleet, ports: dict[str, int], **classifier: Any
                 ) -> dict[str, Any]:
    section = {"message_timeout_ms": 50, "rules": [{"tier": "code", "keywords": ["python"]}]}
    return intent_tier_config(fleet, ports, **{**section, **classifier})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("embedded")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin",
                                            "classifier")}
    fleet = BackendFleet(len(ROLES)).start()
    config_path = workdir / "trimtab.yaml"
    config_path.write_text(yaml.safe_dump(build_config(fleet, ports), sort_keys=False))
    trimtab = TrimtabProcess(config_path, ports["admin"], workdir / "trimtab.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
    stack = Stack(fleet, trimtab, envoy, config_path, ports)
    try:
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api="delta"),
                    workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        wait_until(lambda: stack.lands("python please"), SETTLE_S, "the classifier answering",
                 check=lambda role: role == "intent-code", every=0.1)
        yield stack
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc) if p is not None]
        if trimtab.proc is not None and trimtab.proc.poll() is None:
            os.kill(trimtab.proc.pid, signal.SIGCONT)
        envoy.stop()
        trimtab.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


def test_serve_alone_classifies_requests_onto_the_tier(stack: Stack) -> None:
    assert stack.classifier_listening()
    assert stack.lands("write me some python") == "intent-code"
    assert stack.lands("hello there") == "intent"
    assert stack.lands("python", model="m-plain") == "plain"
    assert stack.trimtab.metric("trimtab_classifier_embedded_up") == 1.0
    assert len(classifier_pids(stack)) == 1  # one child process of trimtab serve


def test_a_reload_applies_new_rules_to_the_running_classifier(stack: Stack) -> None:
    assert stack.lands("some rust please") == "intent"
    stack.reload(rules=[{"tier": "code", "keywords": ["rust"]}])
    wait_until(lambda: stack.lands("some rust please"), SETTLE_S, "the new rule",
             check=lambda role: role == "intent-code", every=0.1)
    assert stack.lands("python please") == "intent"  # the old rule is gone
    stack.reload()
    wait_until(lambda: stack.lands("python please"), SETTLE_S, "the first rules back",
             check=lambda role: role == "intent-code", every=0.1)


def test_a_stopped_classifier_sends_the_request_to_the_default_pool(stack: Stack) -> None:
    allowed = stack.hop_stat("failure_mode_allowed")
    stack.reload(embedded=False)  # Envoy's cluster keeps the address; nothing listens there
    wait_until(stack.classifier_listening, SETTLE_S, "the classifier stopped",
             check=lambda up: not up, every=0.1)
    for _ in range(5):
        assert stack.lands("python please") == "intent"  # default pool, not an error
    assert stack.hop_stat("failure_mode_allowed") >= allowed + 5
    assert stack.trimtab.metric("trimtab_classifier_embedded_up") == 0.0
    stack.reload()
    wait_until(lambda: stack.lands("python please"), SETTLE_S, "the classifier back",
             check=lambda role: role == "intent-code", every=0.2)


def classifier_pids(stack: Stack) -> list[int]:
    """The classifier processes trimtab serve started (children running classify_server)."""
    assert stack.trimtab.proc is not None
    parent, found = stack.trimtab.proc.pid, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == parent and b"xds_server.classify_server" in cmdline:
            found.append(int(stat.parent.name))
    return found


def test_a_hanging_or_killed_classifier_fails_open_and_comes_back(stack: Stack) -> None:
    (pid,) = classifier_pids(stack)
    timeouts = stack.hop_stat("message_timeouts")
    os.kill(pid, signal.SIGSTOP)  # every message now times out
    try:
        for _ in range(3):
            assert stack.lands("python please") == "intent"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stack.hop_stat("message_timeouts") >= timeouts + 3
    wait_until(lambda: stack.lands("python please"), SETTLE_S, "the tier back",
             check=lambda role: role == "intent-code", every=0.1)

    restarts = stack.trimtab.metric("trimtab_classifier_embedded_restarts_total") or 0.0
    os.kill(pid, signal.SIGKILL)  # a crash: trimtab starts it again
    assert stack.lands("python please") in ("intent", "intent-code")  # never an error
    wait_until(lambda: stack.lands("python please"), SETTLE_S, "a new classifier",
             check=lambda role: role == "intent-code", every=0.2)
    assert stack.trimtab.metric("trimtab_classifier_embedded_restarts_total") == restarts + 1
    assert classifier_pids(stack) not in ([], [pid])
