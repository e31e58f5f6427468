"""The classifier `trimtab serve` runs itself (xds_server/classify_server.py): it starts only
for pools with tiers, answers from its own process whatever trimtab's loop is doing, takes new
rules on reload, refuses a new address while it runs, is started again when it dies, never
outlives trimtab, and a bind failure names classifier.address. Through a real Envoy:
tests/integration/test_classifier_embedded_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from trimtab_dev.envoy_process import free_port
from xds_server.app import Trimtab
from xds_server.classify_server import EmbeddedClassifier
from xds_server.config.load import ConfigError, parse_config
from xds_server.config.schema import Config
from xds_server.envoy.request_features import CLASSIFIER_CLUSTER, extra_clusters
from xds_server.listen import CannotListen

ROOT = Path(__file__).resolve().parents[1]
RULES = [{"tier": "code", "keywords": ["python"]}]


def _document(port: int, tiers: bool = True, **classifier: Any) -> dict[str, Any]:
    extra = {"intent_tiers": {"code": "code"}} if tiers else {}
    return {"xds": {"address": f"127.0.0.1:{free_port()}"},
            "admin": {"address": f"127.0.0.1:{free_port()}"},
            "telemetry": {"source": "static", "interval_seconds": 30},
            "classifier": {"address": f"127.0.0.1:{port}", "rules": RULES, **classifier},
            "pools": [{"name": "chat", "model": "m", **extra, "endpoints": [
                          {"address": "127.0.0.1:8001", "signals": {"gpu_mem_pct": 10}}]},
                      {"name": "code", "model": "m" if tiers else "m-code", "endpoints": [
                          {"address": "127.0.0.1:8002", "signals": {"gpu_mem_pct": 10}}]}]}


def _config(port: int, tiers: bool = True, **classifier: Any) -> Config:
    return parse_config(_document(port, tiers, **classifier))


def tier_of(port: int, text: str, timeout: float = 5.0) -> str | None:
    """One ext_proc exchange with the classifier on `port` (a blocking gRPC client)."""
    body = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
    request = ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=body,
                                                                        end_of_stream=True))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        for answer in stub.Process(iter([request]), timeout=timeout):
            headers = answer.request_body.response.header_mutation.set_headers
            return headers[0].header.raw_value.decode() if headers else None
    raise AssertionError("no answer")


def _refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_it_runs_only_for_pools_with_tiers_and_only_when_embedded() -> None:
    async def scenario() -> list[bool]:
        seen = []
        for config in (_config(free_port(), tiers=False), _config(free_port(), embedded=False)):
            classifier = EmbeddedClassifier()
            await classifier.start(config)
            seen.append(classifier.running)
            await classifier.close()
        return seen

    assert asyncio.run(scenario()) == [False, False]


@pytest.mark.slow  # starts the classifier process
def test_it_classifies_on_its_own_loop_while_the_main_loop_is_blocked() -> None:
    port = free_port()

    async def scenario() -> tuple[str | None, float, str | None]:
        classifier = EmbeddedClassifier()
        await classifier.start(_config(port))
        try:
            answers: list[tuple[str | None, float]] = []

            def ask() -> None:
                started = time.monotonic()
                answers.append((tier_of(port, "python, please"), time.monotonic() - started))

            asker = threading.Thread(target=ask)
            asker.start()
            time.sleep(1.5)  # the main loop is stuck (a long tick would be)
            asker.join(5)
            return (*answers[0], tier_of(port, "hello"))
        finally:
            await classifier.close()

    tier, took, other = asyncio.run(scenario())
    assert tier == "code" and other is None
    assert took < 1.0, f"the answer waited for the main loop ({took:.2f} s)"
    assert _refuses_connections(port)  # closed: stopped and joined


@pytest.mark.slow  # starts the classifier process
def test_reload_applies_new_rules_refuses_a_new_address_and_stops_without_tiers() -> None:
    port = free_port()

    async def scenario() -> None:
        classifier = EmbeddedClassifier()
        await classifier.start(_config(port))
        try:
            assert await asyncio.to_thread(tier_of, port, "rust please") is None
            rules = [{"tier": "code", "keywords": ["rust"]}]
            assert await classifier.reload(_config(port, rules=rules)) == []
            assert await asyncio.to_thread(tier_of, port, "rust please") == "code"
            assert await asyncio.to_thread(tier_of, port, "python please") is None

            problems = await classifier.reload(_config(free_port()))
            assert [key for key, _ in problems] == ["classifier.address"]
            assert "restart trimtab" in problems[0][1]
            assert await asyncio.to_thread(tier_of, port, "rust please") == "code"  # unchanged

            assert await classifier.reload(_config(port, tiers=False)) == []
            assert not classifier.running and _refuses_connections(port)
            assert await classifier.reload(_config(port)) == []  # tiers back: started again
            assert await asyncio.to_thread(tier_of, port, "python please") == "code"
        finally:
            await classifier.close()

    asyncio.run(scenario())


@pytest.mark.slow  # starts the classifier process
def test_an_address_in_use_is_cannot_listen_naming_the_key() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def scenario() -> str:
            classifier = EmbeddedClassifier()
            try:
                await classifier.start(_config(port))
            except CannotListen as exc:
                assert not classifier.running
                return str(exc)
            await classifier.close()
            return "started"

        assert asyncio.run(scenario()) == (f"cannot listen on classifier.address "
                                           f"127.0.0.1:{port}: address in use")

        async def reload() -> list[tuple[str, str]]:
            classifier = EmbeddedClassifier()
            return await classifier.reload(_config(port))  # tiers turned on live

        problems = asyncio.run(reload())
        assert problems == [("classifier.address", "cannot start the embedded classifier: "
                                                   "address in use")]


@pytest.mark.slow  # starts the classifier process
def test_serve_exits_2_with_one_line_when_the_classifier_cannot_bind(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "trimtab.yaml"
        path.write_text(yaml.safe_dump(_document(port)))
        done = subprocess.run([sys.executable, "-m", "xds_server.cli", "serve", "--config",
                               str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert (f"trimtab: cannot listen on classifier.address 127.0.0.1:{port}: address in use"
            in done.stderr.splitlines())


def test_the_classifier_cluster_dials_the_embedded_classifier() -> None:
    def dialed(**classifier: Any) -> tuple[str, int]:
        (cluster,) = extra_clusters(_config(18123, **classifier))
        assert cluster.name == CLASSIFIER_CLUSTER
        socket_address = (cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint
                          .address.socket_address)
        return socket_address.address, socket_address.port_value

    assert dialed() == ("127.0.0.1", 18123)
    doc = _document(18124)
    doc["classifier"]["address"] = "0.0.0.0:18124"
    (cluster,) = extra_clusters(parse_config(doc))
    assert cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address \
        .socket_address.address == "127.0.0.1"  # a wildcard listen: Envoy dials loopback
    assert dialed(envoy_address="10.0.0.7:9000") == ("10.0.0.7", 9000)


@pytest.mark.slow  # starts the classifier process
def test_trimtab_reload_refuses_moving_the_running_classifier(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture
                                                              ) -> None:
    port = free_port()
    document = _document(port)
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump(document))

    async def scenario() -> None:
        trimtab = Trimtab(parse_config(document), path)
        await trimtab.start()
        try:
            moved = {**document, "classifier": {**document["classifier"],
                                                "address": f"127.0.0.1:{free_port()}"}}
            moved["telemetry"] = {"source": "static", "interval_seconds": 5}
            path.write_text(yaml.safe_dump(moved))
            assert await trimtab.reload() is False
            assert trimtab.config.telemetry.interval_seconds == 30  # nothing applied
            assert await asyncio.to_thread(tier_of, port, "python") == "code"
            renewed = {**document, "classifier": {**document["classifier"], "rules": [
                {"tier": "code", "keywords": ["haskell"]}]}}
            path.write_text(yaml.safe_dump(renewed))
            assert await trimtab.reload() is True
            assert await asyncio.to_thread(tier_of, port, "haskell") == "code"
        finally:
            await trimtab.close()

    with caplog.at_level(logging.ERROR, logger="trimtab"):
        asyncio.run(scenario())
    refused = [r.getMessage() for r in caplog.records if "reload refused" in r.getMessage()]
    assert any(m.startswith("reload refused: classifier.address: cannot change while the "
                            "embedded classifier listens") for m in refused), refused
    assert _refuses_connections(port)  # close() stopped it


@pytest.mark.slow  # starts the classifier process
def test_a_bind_failure_the_probe_missed_is_cannot_listen_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import xds_server.classify_server as embedded

    monkeypatch.setattr(embedded, "check_bindable", lambda address: None)  # a lost race
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def scenario() -> str:
            classifier = EmbeddedClassifier()
            with pytest.raises(CannotListen) as caught:
                await classifier.start(_config(port))
            assert not classifier.running
            return str(caught.value)

        assert asyncio.run(scenario()) == (f"cannot listen on classifier.address "
                                           f"127.0.0.1:{port}: address in use")


def _metric(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.slow  # starts the classifier process
def test_a_classifier_that_dies_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import xds_server.classify_server as embedded

    monkeypatch.setattr(embedded, "RESTART_AFTER_S", 0.1)
    port = free_port()

    async def scenario() -> None:
        classifier = EmbeddedClassifier()
        await classifier.start(_config(port))
        try:
            restarts = _metric("trimtab_classifier_embedded_restarts_total")
            child = classifier._child
            assert child is not None and child._proc is not None
            child._proc.kill()  # a crash
            for _ in range(200):
                if _metric("trimtab_classifier_embedded_restarts_total") > restarts:
                    break
                await asyncio.sleep(0.05)
            assert _metric("trimtab_classifier_embedded_restarts_total") == restarts + 1
            assert _metric("trimtab_classifier_embedded_up") == 1.0
            assert await asyncio.to_thread(tier_of, port, "python please") == "code"
        finally:
            await classifier.close()
        assert _metric("trimtab_classifier_embedded_up") == 0.0

    asyncio.run(scenario())


@pytest.mark.slow  # starts the classifier process
def test_a_stopped_classifier_is_logged_killed_and_started_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import xds_server.classify_server as embedded

    monkeypatch.setattr(embedded, "RESTART_AFTER_S", 0.2)
    port = free_port()

    async def scenario() -> tuple[int, bool, bool, float]:
        classifier = EmbeddedClassifier()
        await classifier.start(_config(port))
        stopped = classifier._child.pid if classifier._child else None
        assert stopped is not None
        restarts = _metric("trimtab_classifier_embedded_restarts_total")
        try:
            os.kill(stopped, signal.SIGSTOP)
            started, went_down, refused = time.monotonic(), False, False
            while time.monotonic() - started < 20:
                went_down |= _metric("trimtab_classifier_embedded_up") == 0.0
                refused |= went_down and _refuses_connections(port)  # Envoy fails open fast
                if _metric("trimtab_classifier_embedded_restarts_total") > restarts:
                    break
                await asyncio.sleep(0.02)
            took = time.monotonic() - started
            assert _metric("trimtab_classifier_embedded_restarts_total") == restarts + 1
            assert classifier._child is not None and classifier._child.pid != stopped
            assert _metric("trimtab_classifier_embedded_up") == 1.0
            assert await asyncio.to_thread(tier_of, port, "python please") == "code"
            return stopped, went_down, refused, took
        finally:
            if classifier._child is not None and classifier._child.pid == stopped:
                os.kill(stopped, signal.SIGCONT)  # not replaced: let close() stop it quickly
            await classifier.close()

    with caplog.at_level(logging.INFO, logger="trimtab.classify"):
        stopped, went_down, refused, took = asyncio.run(scenario())
    assert went_down, "trimtab_classifier_embedded_up stayed 1 while the child was stopped"
    assert refused, "the port kept accepting connections nobody answered until the restart"
    assert not _running(stopped), "the stopped classifier was left behind"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [f"the embedded classifier (pid {stopped}) did not answer a health "
                      f"check within 1 s: killed, starting a new one in 0.2 s (Envoy fails "
                      f"open meanwhile)"], errors
    assert took < 10, f"detected and replaced after {took:.1f} s"


PARENT = """
import asyncio, os, signal, sys
from xds_server.classify_server import EmbeddedClassifier
from xds_server.config.load import ConfigError, parse_config
import json
config = parse_config(json.loads(sys.argv[1]))
async def main():
    classifier = EmbeddedClassifier()
    await classifier.start(config)
    print(classifier._child._proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up of any kind
asyncio.run(main())
"""


@pytest.mark.slow  # starts the classifier process
def test_the_classifier_never_outlives_a_killed_trimtab() -> None:
    port = free_port()
    parent = subprocess.run([sys.executable, "-c", PARENT, json.dumps(_document(port))],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert parent.returncode == -9, parent.stderr
    child = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "the classifier outlived its trimtab"
    assert _refuses_connections(port)


def _running(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie waits for init to reap it)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


LEARNED = {"learned": "tests.support.learned_classifier:make", "learned_tiers": ["fp"]}


def _learned_document(port: int, **classifier: Any) -> dict[str, Any]:
    document = _document(port, **{**LEARNED, **classifier})
    document["pools"][0]["intent_tiers"] = {"code": "code", "fp": "code"}
    return document


@pytest.mark.slow  # starts the classifier process
def test_a_learned_classifier_answers_what_no_rule_matches_in_the_child() -> None:
    port = free_port()

    async def scenario() -> None:
        classifier = EmbeddedClassifier()
        await classifier.start(parse_config(_learned_document(port)))
        try:
            assert await asyncio.to_thread(tier_of, port, "python please") == "code"  # a rule
            assert await asyncio.to_thread(tier_of, port, "Haskell please") == "fp"  # learned
            assert await asyncio.to_thread(tier_of, port, "a crash, then?") is None  # its error
            problems = await classifier.reload(parse_config(_learned_document(
                port, learned="tests.support.learned_classifier:broken")))
            assert problems and problems[0][0] == "classifier.learned"
            assert "weights not found" in problems[0][1]
            assert await asyncio.to_thread(tier_of, port, "Haskell please") == "fp"  # kept
        finally:
            await classifier.close()

    asyncio.run(scenario())


@pytest.mark.slow  # starts trimtab serve and its classifier process
def test_serve_exits_2_naming_a_learned_classifier_that_cannot_load(tmp_path: Path) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump(_learned_document(
        free_port(), learned="tests.support.learned_classifier:not_a_classifier")))
    done = subprocess.run([sys.executable, "-m", "xds_server.cli", "serve", "--config",
                           str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert ("trimtab: cannot start: classifier.learned: "
            "'tests.support.learned_classifier:not_a_classifier' returned str, which has no "
            "classify(text)") in done.stderr.splitlines()


def test_learned_tiers_count_as_tiers_and_the_factory_key_is_checked() -> None:
    config = parse_config(_learned_document(18200))
    assert config.classifier is not None and config.classifier.learned_tiers == ["fp"]
    without = _learned_document(18200)
    without["classifier"]["learned_tiers"] = []
    with pytest.raises(ConfigError, match=r"pools\[chat\]\.intent_tiers\.fp: no classifier rule"):
        parse_config(without)
    bad = _learned_document(18200, learned="not a module path")
    with pytest.raises(ConfigError, match=r"classifier\.learned"):
        parse_config(bad)


def test_restarts_back_off_and_a_stable_child_resets_the_backoff() -> None:
    from xds_server.classify_server import (
        MAX_RESTART_AFTER_S,
        RESTART_AFTER_S,
        STABLE_AFTER_S,
        _Backoff,
    )

    backoff = _Backoff()
    waits = [backoff.next_wait() for _ in range(8)]
    assert waits[:3] == [RESTART_AFTER_S, 2 * RESTART_AFTER_S, 4 * RESTART_AFTER_S]
    assert waits[-1] == MAX_RESTART_AFTER_S and waits == sorted(waits)
    backoff.healthy(100.0)
    backoff.healthy(100.0 + STABLE_AFTER_S / 2)
    assert backoff.next_wait() == MAX_RESTART_AFTER_S  # not stable long enough
    backoff.healthy(200.0)
    backoff.healthy(200.0 + STABLE_AFTER_S)
    assert backoff.next_wait() == RESTART_AFTER_S
