"""The intent classifier's pieces: rules, message extraction, bounds, the ext_proc answer, and
its config keys (exit 2 naming the key). End to end: tests/integration/test_classifier_e2e.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2 as ext_proc_config
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from trimtab_dev.envoy_process import free_port
from xds_server.classify import RulesClassifier, decide, last_user_text, main, tier_response
from xds_server.cli import EXIT_BAD_INPUT
from xds_server.cli import main as trimtab
from xds_server.config.load import parse_config
from xds_server.config.schema import ClassifierConfig, ClassifierRuleConfig
from xds_server.envoy.routes import build_route_config, http_filters

RULES = [{"tier": "code", "keywords": ["Python", "stack trace"], "patterns": [r"\bdef \w+\("]},
         {"tier": "long", "min_chars": 100},
         {"tier": "short", "max_chars": 5}]


def _limits(**extra: Any) -> ClassifierConfig:
    return ClassifierConfig.model_validate({"rules": RULES, **extra})


def test_rules_match_in_order_keywords_ignore_case() -> None:
    rules = RulesClassifier([ClassifierRuleConfig.model_validate(r) for r in RULES])
    assert rules.classify("some PYTHON please") == "code"
    assert rules.classify("what is def main(argv) for") == "code"
    assert rules.classify("x" * 100) == "long"
    assert rules.classify("python " * 30) == "code"  # first rule wins over length
    assert rules.classify("hey") == "short"
    assert rules.classify("hello there") is None


def test_the_last_user_message_is_read_from_chat_and_responses_bodies() -> None:
    chat = {"messages": [{"role": "user", "content": "first"},
                         {"role": "assistant", "content": "python"},
                         {"role": "user", "content": [{"type": "text", "text": "second"},
                                                      {"type": "image_url", "image_url": {}}]}]}
    assert last_user_text(chat) == "second"
    assert last_user_text({"input": "plain"}) == "plain"
    assert last_user_text({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "resp"}]}]}) == "resp"
    for odd in (None, [], {"messages": "x" * 0}, {"messages": [1, "a"]}, {"messages": {}}):
        assert last_user_text(odd) in (None, "")


def test_decide_is_bounded_and_defaults_on_anything_unreadable() -> None:
    rules = RulesClassifier([ClassifierRuleConfig.model_validate(r) for r in RULES])
    limits = _limits(max_body_bytes=1024, max_text_chars=20)
    body = json.dumps({"messages": [{"role": "user", "content": "python"}]}).encode()
    assert decide(rules, body, limits) == "code"
    late = json.dumps({"messages": [{"role": "user", "content": "a" * 30 + " python"}]})
    assert decide(rules, late.encode(), limits) is None  # past max_text_chars: not seen
    big = json.dumps({"messages": [{"role": "user", "content": "python" + "a" * 2000}]})
    assert decide(rules, big.encode(), limits) is None  # over max_body_bytes: not parsed
    assert decide(rules, b"{not json", limits) is None
    assert decide(rules, b"[" * 900 + b"]" * 900, limits) is None  # deep: no crash


def test_the_answer_carries_metadata_header_and_clears_the_route() -> None:
    answer = tier_response("code")
    common = answer.request_body.response
    assert common.clear_route_cache
    assert common.header_mutation.set_headers[0].header.key == "x-trimtab-tier"
    assert common.header_mutation.set_headers[0].header.raw_value == b"code"
    assert answer.dynamic_metadata["trimtab.classifier"]["tier"] == "code"
    empty = tier_response(None)
    assert empty.WhichOneof("response") == "request_body"
    assert not empty.request_body.response.clear_route_cache
    assert not empty.dynamic_metadata.fields


def _pools(code_model: str = "m2", **intent: Any) -> list[dict[str, Any]]:
    return [{"name": "intent", "model": "m", "endpoints": [{"address": "10.0.0.1:80"}], **intent},
            {"name": "intent-code", "model": code_model,
             "endpoints": [{"address": "10.0.0.2:80"}]},
            {"name": "plain", "model": "p", "endpoints": [{"address": "10.0.0.3:80"}]}]


def _hop(route: Any) -> bool:
    per_route = ext_proc_config.ExtProcPerRoute()
    assert route.typed_per_filter_config["envoy.filters.http.ext_proc"].Unpack(per_route)
    return not per_route.disabled


def test_only_routes_of_pools_with_tiers_take_the_hop() -> None:
    config = parse_config({"classifier": {"rules": RULES},
                           "pools": _pools("m", intent_tiers={"code": "intent-code"})})
    names = [f["name"] for f in http_filters(config)]
    assert names[-2:] == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    routes = build_route_config(config).virtual_hosts[0].routes
    hop = {r.name: _hop(r) for r in routes}
    assert hop["body:intent"] and hop["body:intent:tier:code"] and hop["header:intent"]
    assert not hop["body:plain"] and not hop["no-model"] and not hop["body:unknown"]
    without = parse_config({"classifier": {"rules": RULES}, "pools": _pools()})
    assert "envoy.filters.http.ext_proc" not in [f["name"] for f in http_filters(without)]


BAD = [
    ({"classifier": {"rules": RULES}, "pools": _pools("m", intent_tiers={"nope": "intent-code"})},
     "pools[intent].intent_tiers.nope: no classifier rule puts requests in tier 'nope'"),
    ({"pools": _pools("m", intent_tiers={"code": "intent-code"})},
     "pools[intent].intent_tiers.code: intent tiers need a top-level `classifier`"),
    ({"classifier": {"rules": RULES}, "pools": _pools(intent_tiers={"code": "gone"})},
     "pools[intent].intent_tiers.code: expected another pool's name"),
    ({"classifier": {"rules": [{"tier": "x", "patterns": ["(unclosed"]}]}, "pools": _pools()},
     "classifier.rules[0].patterns: pattern '(unclosed' is not a regular expression"),
    ({"classifier": {"rules": [{"tier": "a b"}]}, "pools": _pools()}, "classifier.rules[0].tier"),
    ({"classifier": {"rules": []}, "pools": _pools()}, "classifier.rules"),
    ({"classifier": {"rules": RULES, "address": "localhost:1"}, "pools": _pools()},
     "classifier.address: expected an IP address"),
    ({"classifier": {"rules": RULES, "message_timeout_ms": 0}, "pools": _pools()},
     "classifier.message_timeout_ms"),
]


@pytest.mark.parametrize(("document", "named"), BAD, ids=[n.split(":")[0] for _, n in BAD])
def test_bad_classifier_keys_exit_2_naming_them(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                document: dict[str, Any], named: str) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump(document))
    assert trimtab(["validate", "--config", str(path)]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


def test_classify_without_a_classifier_section_exits_2(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump({"pools": _pools()}))
    assert main(["--config", str(path)]) == EXIT_BAD_INPUT
    assert "no `classifier` section" in capsys.readouterr().err


def test_classify_exits_2_when_the_learned_classifier_cannot_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(yaml.safe_dump({
        "classifier": {"rules": RULES, "learned": "tests.support.learned_classifier:broken"},
        "pools": _pools()}))
    assert main(["--config", str(path)]) == EXIT_BAD_INPUT
    assert ("trimtab classify: classifier.learned: cannot load "
            "'tests.support.learned_classifier:broken': RuntimeError: weights not found"
            in capsys.readouterr().err)


def test_the_learned_classifier_is_asked_only_when_no_rule_matches() -> None:
    from xds_server.classify import build_classifier

    limits = _limits(learned="tests.support.learned_classifier:make", learned_tiers=["fp"])
    classifier = build_classifier(limits)
    assert classifier.classify("python in haskell") == "code"  # the rule first
    assert classifier.classify("haskell, please") == "fp"
    assert classifier.classify("crash it") is None  # its error: the default tier
    assert isinstance(build_classifier(_limits()), RulesClassifier)  # no plug-in: rules only


def test_settle_heap_puts_what_exists_out_of_the_collectors_reach() -> None:
    import gc

    from xds_server.classify import settle_heap

    gc.unfreeze()
    try:
        settle_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # grpc, the protos and pydantic are loaded in this process
        assert len(gc.get_objects(generation=2)) < frozen  # a full collection skips them
    finally:
        gc.unfreeze()


# -- the time budget and the stream bounds ------------------------------------------------------

BACKTRACKING = [{"tier": "logs", "patterns": [".*error.*traceback"]}]


def _body(text: str) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()


def _unreadable(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("trimtab_classifier_unreadable_total",
                                     {"reason": reason}) or 0.0


def test_a_backtracking_rule_stops_at_the_budget_and_takes_the_default_tier() -> None:
    from xds_server.classify import budget_seconds, decide_in_time

    limits = ClassifierConfig.model_validate({"rules": BACKTRACKING, "message_timeout_ms": 50})
    rules = RulesClassifier(limits.rules)
    before = _unreadable("over_budget")
    started = time.perf_counter()
    tier = decide_in_time(rules, _body("error " * 1366), limits)  # 8 kB: minutes unbounded
    took = time.perf_counter() - started
    assert tier is None and _unreadable("over_budget") == before + 1
    assert budget_seconds(limits) == 0.025
    assert took < 0.25, f"the decision took {took:.2f} s, budget 0.025 s"
    assert decide_in_time(rules, _body("an error, then a traceback"), limits) == "logs"


class _Swallower:
    """A learned classifier that catches every Exception (and spins)."""

    def classify(self, text: str) -> str | None:
        try:
            while True:
                pass
        except Exception:  # noqa: BLE001 - the point: OverBudget is not an Exception
            return "swallowed"


def test_a_learned_classifier_cannot_swallow_the_budget() -> None:
    from xds_server.classify import ChainedClassifier, decide_in_time

    limits = _limits(message_timeout_ms=20)
    chained = ChainedClassifier(RulesClassifier(limits.rules), _Swallower())
    assert decide_in_time(chained, _body("hello there"), limits) is None


def test_the_budget_puts_back_the_alarm_it_borrowed() -> None:
    from xds_server.classify_budget import OverBudget, run_within

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    previous_timer = signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        assert run_within(0.01, lambda: 7) == 7
        with pytest.raises(OverBudget):
            run_within(0.01, lambda: time.sleep(1))
        time.sleep(0.5)
        assert fired == [signal.SIGALRM]  # the earlier timer still fired, to its own handler
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *previous_timer)


def _ask(port: int, *requests: ext_proc.ProcessingRequest) -> tuple[str | None, float]:
    """The tier an ext_proc stream of `requests` gets, and how long it took (blocking)."""
    started = time.perf_counter()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ext_proc_grpc.ExternalProcessorStub(channel)
        answers = list(stub.Process(iter(requests), timeout=5))
    headers = answers[-1].request_body.response.header_mutation.set_headers
    return (headers[0].header.raw_value.decode() if headers else None,
            time.perf_counter() - started)


def _body_request(text: str) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=_body(text),
                                                                     end_of_stream=True))


async def _serving(limits: ClassifierConfig) -> tuple[grpc.aio.Server, int]:
    from xds_server.classify import ExtProcService, build_classifier, build_server

    server, port = build_server(ExtProcService(build_classifier(limits), limits),
                                f"127.0.0.1:{free_port()}")
    await server.start()
    return server, port


def test_an_adversarial_prompt_does_not_hold_other_requests_past_the_budget() -> None:
    limits = ClassifierConfig.model_validate({"rules": [*BACKTRACKING, *RULES],
                                              "message_timeout_ms": 50})

    async def scenario() -> list[tuple[str | None, float]]:
        server, port = await _serving(limits)
        try:
            await asyncio.to_thread(_ask, port, _body_request("python"))  # connected, warm
            slow = asyncio.create_task(asyncio.to_thread(
                _ask, port, _body_request("error " * 1366)))
            await asyncio.sleep(0.005)
            others = [await asyncio.to_thread(_ask, port, _body_request("python"))
                      for _ in range(5)]
            return [await slow, *others]
        finally:
            await server.stop(None)

    adversarial, *others = asyncio.run(scenario())
    assert adversarial[0] is None and adversarial[1] < 1.0
    assert [tier for tier, _ in others] == ["code"] * 5
    worst = max(took for _, took in others)
    assert worst < 0.5, f"another request waited {worst:.2f} s behind the adversarial one"


def _stream_error(port: int, *requests: ext_proc.ProcessingRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _ask(port, *requests)
    return caught.value


def test_oversized_headers_and_overlong_streams_are_refused_naming_the_bound() -> None:
    from xds_server.classify import MAX_HEADERS_BYTES, MAX_MESSAGES_PER_STREAM

    big = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders())
    header = big.request_headers.headers.headers.add()
    header.key, header.raw_value = "x-big", b"a" * (MAX_HEADERS_BYTES + 1)
    small = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders())

    async def scenario() -> tuple[grpc.RpcError, grpc.RpcError, tuple[str | None, float]]:
        server, port = await _serving(_limits())
        try:
            return (await asyncio.to_thread(_stream_error, port, big),
                    await asyncio.to_thread(_stream_error, port,
                                            *[small] * (MAX_MESSAGES_PER_STREAM + 1)),
                    await asyncio.to_thread(_ask, port, small, _body_request("python")))
        finally:
            await server.stop(None)

    headers, long_stream, fine = asyncio.run(scenario())
    assert headers.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert headers.details().startswith("request_headers: ")
    assert f"over the classifier's limit of {MAX_HEADERS_BYTES}" in headers.details()
    assert long_stream.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than {MAX_MESSAGES_PER_STREAM} messages" in long_stream.details()
    assert fine[0] == "code"
