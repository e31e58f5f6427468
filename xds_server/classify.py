"""`trimtab classify`: the intent classifier, an Envoy ext_proc service over gRPC.

Envoy sends the request headers (answered at once) and the buffered body of requests for pools
with ``intent_tiers``; the service reads the last user message and answers with the tier: in
dynamic metadata ``trimtab.classifier.tier`` (what the routes match: a client cannot forge it)
and in the ``x-trimtab-tier`` header (for the model server to see), and asks Envoy to match the
route again. No tier: an empty answer, and the request takes the pool's default route. Envoy
fails open (``failure_mode_allow``, ``message_timeout``), so a slow or dead classifier costs a
request its tier, never the request.

Rules are built in (keywords, regular expressions, prompt length; first match wins). A learned
classifier plugs in through `Classifier`: any object with ``classify(text) -> tier | None``,
made by the factory ``classifier.learned: module:factory`` names and asked when no rule
matches (`build_classifier`).

Bounded (docs/security.md, "Intent classifier and KEDA scaler"): one gRPC message at most
`MAX_MESSAGE_BYTES`, the call's metadata `MAX_METADATA_BYTES`, a ``request_headers`` message
`MAX_HEADERS_BYTES` and a stream `MAX_MESSAGES_PER_STREAM` messages (over: the stream is
refused with INVALID_ARGUMENT naming the bound, and Envoy fails open); bodies over
``classifier.max_body_bytes`` are not parsed, at most ``classifier.max_text_chars`` of the
message are looked at, and each decision has half of ``classifier.message_timeout_ms`` (the
time Envoy waits for it): past that it stops and the request takes the default tier
(`decide_in_time`). The port is never shared (``grpc.so_reuseport`` 0).

Exit status: 0 after SIGINT/SIGTERM, 1 when the address cannot be bound, 2 on a bad config
(a `classifier.learned` that cannot be loaded included).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import logging
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from prometheus_client import Counter, Histogram, start_http_server

from xds_server.classify_budget import OverBudget, run_within
from xds_server.config.addresses import parse_host_port
from xds_server.config.load import ConfigError, load_config
from xds_server.config.schema import ClassifierConfig, ClassifierRuleConfig
from xds_server.envoy.request_features import CLASSIFIER_NAMESPACE, TIER_HEADER

log = logging.getLogger("trimtab.classify")
EXIT_BAD_INPUT = 2
DEFAULT_TIER = "default"  # the metric label of "no tier"

DECISIONS = Counter("trimtab_classifier_decisions_total",
                    "Requests classified, by tier (default: no rule matched or unreadable)",
                    ["tier"])
UNREADABLE = Counter("trimtab_classifier_unreadable_total",
                     "Bodies the classifier could not read (they take the default tier)",
                     ["reason"])
REFUSED = Counter("trimtab_classifier_refused_total",
                  "ext_proc streams the classifier refused for exceeding a bound", ["bound"])
DECISION_SECONDS = Histogram("trimtab_classifier_decision_seconds",
                             "Time to parse a body and classify it",
                             buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                      0.025, 0.05))


MAX_MESSAGE_BYTES = 9 * 1024 * 1024  # the largest classifier.max_body_bytes (8 MiB) + slack
MAX_METADATA_BYTES = 16 * 1024      # the gRPC call's own headers (Envoy sends a few hundred)
MAX_HEADERS_BYTES = 128 * 1024      # a request_headers message (Envoy's default limit: 60 KiB)
MAX_MESSAGES_PER_STREAM = 8         # Envoy sends a request's headers, then its buffered body


class Classifier(Protocol):
    """What a learned classifier implements: the tier of one user message, or None."""

    def classify(self, text: str) -> str | None: ...


@dataclass(frozen=True)
class _Rule:
    tier: str
    keywords: tuple[str, ...]
    pattern: re.Pattern[str] | None
    min_chars: int
    max_chars: int | None

    def matches(self, text: str, lowered: str) -> bool:
        if len(text) < self.min_chars or (self.max_chars is not None
                                          and len(text) >= self.max_chars):
            return False
        if not self.keywords and self.pattern is None:
            return True
        return any(k in lowered for k in self.keywords) or (
            self.pattern is not None and self.pattern.search(text) is not None)


class RulesClassifier:
    """The built-in rules, in order; the first that matches names the tier."""

    def __init__(self, rules: Sequence[ClassifierRuleConfig]) -> None:
        self._rules = tuple(_compile(rule) for rule in rules)

    def classify(self, text: str) -> str | None:
        lowered = text.lower()
        for rule in self._rules:
            if rule.matches(text, lowered):
                return rule.tier
        return None


class ChainedClassifier:
    """The rules first; for a text no rule puts in a tier, the learned classifier. An error of
    the learned one is counted (``learned_error``) and means the default tier."""

    def __init__(self, rules: Classifier, learned: Classifier) -> None:
        self.rules, self.learned = rules, learned

    def classify(self, text: str) -> str | None:
        tier = self.rules.classify(text)
        if tier is not None:
            return tier
        try:
            found = self.learned.classify(text)
        except Exception:  # noqa: BLE001 - the plug-in's fault: the default tier, counted
            UNREADABLE.labels("learned_error").inc()
            return None
        return found if isinstance(found, str) and found else None


def build_classifier(limits: ClassifierConfig) -> Classifier:
    """The rules, then ``classifier.learned`` when set. Raises ValueError naming the key."""
    rules = RulesClassifier(limits.rules)
    if limits.learned is None:
        return rules
    module, _, name = limits.learned.partition(":")
    try:
        learned = getattr(importlib.import_module(module), name)(limits)
    except Exception as exc:  # noqa: BLE001 - whatever the plug-in raises, said in one line
        raise ValueError(f"classifier.learned: cannot load {limits.learned!r}: "
                         f"{type(exc).__name__}: {exc}") from None
    if not callable(getattr(learned, "classify", None)):
        raise ValueError(f"classifier.learned: {limits.learned!r} returned "
                         f"{type(learned).__name__}, which has no classify(text)")
    return ChainedClassifier(rules, learned)


def _compile(rule: ClassifierRuleConfig) -> _Rule:
    pattern = re.compile("|".join(f"(?:{p})" for p in rule.patterns)) if rule.patterns else None
    return _Rule(rule.tier, tuple(k.lower() for k in rule.keywords if k), pattern,
                 rule.min_chars, rule.max_chars)


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)
                 and part.get("type") in ("text", "input_text")]
        joined = " ".join(t for t in texts if isinstance(t, str))
        return joined or None
    return None


def last_user_text(body: Any) -> str | None:
    """The last user message of a chat (``messages``) or Responses (``input``) request."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages", body.get("input"))
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return _text_of(message.get("content"))
    return None


def decide(classifier: Classifier, raw: bytes, limits: ClassifierConfig) -> str | None:
    """The tier of one request body; None (the default) when unreadable or unmatched."""
    if len(raw) > limits.max_body_bytes:
        UNREADABLE.labels("too_large").inc()
        return None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        UNREADABLE.labels("not_json").inc()
        return None
    text = last_user_text(body)
    if text is None:
        UNREADABLE.labels("no_user_text").inc()
        return None
    return classifier.classify(text[:limits.max_text_chars])


def budget_seconds(limits: ClassifierConfig) -> float:
    """Each decision's time: half of what Envoy waits for the answer (its other half is left
    to the requests queued behind it)."""
    return limits.message_timeout_ms / 2000


_warned_over_budget = False


def decide_in_time(classifier: Classifier, raw: bytes, limits: ClassifierConfig) -> str | None:
    """`decide`, stopped at `budget_seconds` (in the main thread): over it, None (the default
    tier), counted as ``over_budget`` and logged the first time."""
    global _warned_over_budget
    try:
        return run_within(budget_seconds(limits), lambda: decide(classifier, raw, limits))
    except OverBudget:
        UNREADABLE.labels("over_budget").inc()
        if not _warned_over_budget:
            _warned_over_budget = True
            log.warning("a decision ran past its budget of %.0f ms (half of classifier."
                        "message_timeout_ms) and took the default tier: a classifier.rules "
                        "pattern that backtracks, or a slow classifier.learned; counted in "
                        "trimtab_classifier_unreadable_total{reason=\"over_budget\"}, logged "
                        "once", budget_seconds(limits) * 1000)
        return None


def tier_response(tier: str | None) -> ext_proc.ProcessingResponse:
    response = ext_proc.ProcessingResponse()
    response.request_body.SetInParent()  # an answer to the body even when it says nothing
    if tier is None:
        return response
    common = response.request_body.response
    common.clear_route_cache = True
    header = common.header_mutation.set_headers.add()
    header.header.key = TIER_HEADER
    header.header.raw_value = tier.encode()
    header.append_action = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    response.dynamic_metadata.update({CLASSIFIER_NAMESPACE: {"tier": tier}})
    return response


_EMPTY = {
    "request_headers": lambda: ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()),
    "response_headers": lambda: ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse()),
    "response_body": lambda: ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse()),
    "request_trailers": lambda: ext_proc.ProcessingResponse(
        request_trailers=ext_proc.TrailersResponse()),
    "response_trailers": lambda: ext_proc.ProcessingResponse(
        response_trailers=ext_proc.TrailersResponse()),
}


def over_bound(request: ext_proc.ProcessingRequest, kind: str | None,
               count: int) -> tuple[str, str] | None:
    """(bound, message) when the `count`-th message of a stream exceeds a bound, else None."""
    if count > MAX_MESSAGES_PER_STREAM:
        return ("messages", f"more than {MAX_MESSAGES_PER_STREAM} messages on one ext_proc "
                            f"stream (the classifier takes a request's headers and its "
                            f"buffered body)")
    if kind == "request_headers":
        size = request.request_headers.ByteSize()
        if size > MAX_HEADERS_BYTES:
            return ("request_headers", f"request_headers: {size} bytes, over the "
                                       f"classifier's limit of {MAX_HEADERS_BYTES}")
    return None


class ExtProcService(ext_proc_grpc.ExternalProcessorServicer):
    """One gRPC stream per HTTP request: every message gets its answer."""

    def __init__(self, classifier: Classifier, limits: ClassifierConfig) -> None:
        self.rules: tuple[Classifier, ClassifierConfig] = (classifier, limits)

    def update(self, classifier: Classifier, limits: ClassifierConfig) -> None:
        """New rules and bounds for the next body (one assignment: a body sees old or new)."""
        self.rules = (classifier, limits)

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ext_proc.ProcessingResponse]:
        count = 0
        async for request in request_iterator:
            count += 1
            kind = request.WhichOneof("request")
            problem = over_bound(request, kind, count)
            if problem is not None:
                REFUSED.labels(problem[0]).inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem[1])
            if kind == "request_body":
                started = time.perf_counter()
                classifier, limits = self.rules
                tier = decide_in_time(classifier, request.request_body.body, limits)
                DECISION_SECONDS.observe(time.perf_counter() - started)
                DECISIONS.labels(tier or DEFAULT_TIER).inc()
                yield tier_response(tier)
            elif kind in _EMPTY:
                yield _EMPTY[kind]()


def settle_heap() -> None:
    """Move everything allocated so far (grpc, the Envoy protos, pydantic: ~47k objects) out of
    the collector's reach: a full collection over them stalled the loop for about 20 ms, and
    a request behind it waited that long. Call once serving has started."""
    gc.collect()
    gc.freeze()


def build_server(service: ExtProcService, address: str) -> tuple[grpc.aio.Server, int]:
    """The classifier's gRPC server bound to `address` (not started) and its port. Raises
    OSError or RuntimeError (grpcio) when the address cannot be bound."""
    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 0),  # it sees every prompt: no other process may share the port
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_concurrent_streams", 10_000)])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(service, server)
    port = server.add_insecure_port(str(parse_host_port(address)))
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port


async def serve_classifier(limits: ClassifierConfig, classifier: Classifier,
                           stop: asyncio.Event) -> None:
    server, _ = build_server(ExtProcService(classifier, limits), limits.address)
    await server.start()
    settle_heap()
    log.info("classifier listening on %s (%d rules)", limits.address, len(limits.rules))
    try:
        await stop.wait()
    finally:
        await server.stop(grace=1.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trimtab classify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the trimtab config (its `classifier`)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    return parser


async def _run(limits: ClassifierConfig, classifier: Classifier) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve_classifier(limits, classifier, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"trimtab classify: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if config.classifier is None:
        print("trimtab classify: classifier: the config has no `classifier` section",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    limits = config.classifier
    try:
        classifier = build_classifier(limits)
    except ValueError as exc:
        print(f"trimtab classify: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if limits.metrics_address is not None:
            metrics_at = parse_host_port(limits.metrics_address)
            start_http_server(metrics_at.port, metrics_at.host)
        asyncio.run(_run(limits, classifier))
    except OSError as exc:
        print(f"trimtab classify: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
