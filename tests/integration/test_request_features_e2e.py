"""Request features end to end: ``trimtab serve`` + a real Envoy + fake model servers.

Every request is answered by a backend that says who it is, so each test checks where a request
landed (and where it must not): generation/sampling classes (max_tokens, stream, n,
temperature), modality (image parts, with a bounded inspection), and Envoy's own answers when nothing can serve
(OpenAI-shaped JSON with Retry-After, a pool's static answer).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import TrimtabProcess
from tests.support import BackendFleet
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap

pytestmark = pytest.mark.slow

SETTLE_S = 15.0
INSPECT_BYTES = 64 * 1024
RETRY_AFTER_S = 7
ROLES = ["chat", "chat-vl", "chat-longgen", "chat-batch", "dead", "static", "slow", "tight",
         "ver", "ver-next", "ver-next", "ver-next"]
STATIC_BODY = json.dumps({"choices": [{"message": {"role": "assistant",
                                                   "content": "We are busy; try later."}}]})
SLOW_TIMEOUT_S = 0.3
DEAD = ("dead", "static")  # killed: connections refused


@dataclass
class Stack:
    fleet: BackendFleet
    trimtab: TrimtabProcess
    envoy: EnvoyProcess
    port: int

    def at(self, role: str) -> str:
        return self.fleet.addresses[ROLES.index(role)]

    def indices(self, role: str) -> list[int]:
        return [i for i, name in enumerate(ROLES) if name == role]

    def role_of(self, address: str) -> str:
        return ROLES[self.fleet.addresses.index(address)]


def _pool(role: str, model: str, **extra: Any) -> dict[str, Any]:
    return {"name": role, "model": model, **extra}


HEALTH = {"path": "/health", "interval_seconds": 0.25, "timeout_seconds": 0.5,
          "unhealthy_threshold": 1, "healthy_threshold": 1}


def build_config(fleet: BackendFleet, ports: dict[str, int]) -> dict[str, Any]:
    classes = [{"pool": "chat-vl", "modality": "image"},
               {"pool": "chat-longgen", "max_tokens": {"min": 4097}},
               {"pool": "chat-batch", "stream": False},
               {"pool": "chat-batch", "n": {"min": 2}},
               {"pool": "chat-longgen", "temperature": {"min": 1.5}}]
    pools = [
        _pool("chat", "m-chat", request_classes=classes),
        _pool("chat-vl", "m-chat"), _pool("chat-longgen", "m-chat"),
        _pool("chat-batch", "m-chat"),
        _pool("dead", "m-dead"),
        _pool("static", "m-static", static_response={"status": 200, "body": STATIC_BODY}),
        _pool("slow", "m-slow", timeouts={"request_seconds": SLOW_TIMEOUT_S},
              retry_policy={"num_retries": 0}),
        _pool("tight", "m-tight", circuit_breakers={"max_connections": 1,
                                                    "max_pending_requests": 1,
                                                    "max_requests": 1},
              retry_policy={"num_retries": 0}),
        _pool("ver", "m-ver", model_versions={"pools": {"2": "ver-next"}}),
        _pool("ver-next", "m-ver", affinity={"header": "x-session-id", "hash": "ring_hash"},
              health_check=HEALTH),
    ]
    for pool in pools:
        pool["endpoints"] = [{"address": address} for address, role
                             in zip(fleet.addresses, ROLES, strict=True) if role == pool["name"]]
    return {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}",
                     "local_replies": {"retry_after_seconds": RETRY_AFTER_S},
                     "modality_inspect_bytes": INSPECT_BYTES},
        "telemetry": {"interval_seconds": 0.5, "stale_after_seconds": 3.0},
        "pools": pools,
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("features")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    fleet = BackendFleet(len(ROLES), health_path="/health").start()
    for role in DEAD:
        fleet.kill(ROLES.index(role))
    config_path = workdir / "trimtab.yaml"
    config_path.write_text(yaml.safe_dump(build_config(fleet, ports), sort_keys=False))
    trimtab = TrimtabProcess(config_path, ports["admin"], workdir / "trimtab.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "2"])
    try:
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api="delta"),
                    workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        stack = Stack(fleet, trimtab, envoy, ports["listener"])
        wait_until(lambda: _send(stack, _chat()).status, SETTLE_S, "the chat pool answering",
                   check=lambda status: status == 200, every=0.1)
        yield stack
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc) if p is not None]
        envoy.stop()
        trimtab.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


# -- client -------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def backend(self) -> str | None:
        if self.status != 200:
            return None
        if self.raw.startswith(b"data:"):  # SSE: the first event names the backend
            return json.loads(self.raw.split(b"\n", 1)[0][5:]).get("backend")
        return json.loads(self.raw).get("backend")

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


def _chat(model: str | None = "m-chat", content: Any = "hi", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], **fields}
    if model is not None:
        body["model"] = model
    return body


def _send(stack: Stack, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
          ) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=raw,
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def _lands(stack: Stack, body: dict[str, Any] | bytes, headers: dict[str, str] | None = None
           ) -> str:
    reply = _send(stack, body, headers)
    assert reply.status == 200, (reply.status, reply.raw[:300])
    assert reply.backend is not None
    return stack.role_of(reply.backend)


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}


# -- generation and sampling --------------------------------------------------------------------


def test_max_tokens_above_the_threshold_goes_to_the_long_generation_pool(stack: Stack) -> None:
    assert _lands(stack, _chat(max_tokens=5000)) == "chat-longgen"
    assert _lands(stack, _chat(max_completion_tokens=8192)) == "chat-longgen"
    assert _lands(stack, _chat(max_tokens=4097.0)) == "chat-longgen"
    # the header names the model, the body only the feature
    assert _lands(stack, _chat(model=None, max_tokens=5000), {"x-model": "m-chat"}) == \
        "chat-longgen"


def test_short_or_missing_max_tokens_never_reaches_the_long_generation_pool(stack: Stack) -> None:
    assert _lands(stack, _chat(max_tokens=4096)) == "chat"
    assert _lands(stack, _chat()) == "chat"  # no field: the default
    # max_completion_tokens (OpenAI's current name) wins over the deprecated max_tokens
    assert _lands(stack, _chat(max_tokens=5000, max_completion_tokens=100)) == "chat"
    assert _lands(stack, _chat(max_tokens="lots")) == "chat"  # not a number: the default


def test_non_streaming_requests_go_to_the_batch_pool_streaming_never(stack: Stack) -> None:
    assert _lands(stack, _chat(stream=False)) == "chat-batch"
    streamed = _send(stack, _chat(stream=True))
    assert streamed.status == 200 and streamed.headers["content-type"] == "text/event-stream"
    assert streamed.backend is not None and stack.role_of(streamed.backend) == "chat"
    assert _lands(stack, _chat(stream="false")) == "chat"  # a string is not a JSON bool


def test_n_and_temperature_ranges_pick_their_pools(stack: Stack) -> None:
    assert _lands(stack, _chat(n=3)) == "chat-batch"
    assert _lands(stack, _chat(temperature=1.8)) == "chat-longgen"
    assert _lands(stack, _chat(temperature="1.5")) == "chat-longgen"  # a numeric string counts


def test_n_and_temperature_outside_their_ranges_never_leave_the_default(stack: Stack) -> None:
    assert _lands(stack, _chat(n=1)) == "chat"
    assert _lands(stack, _chat(temperature=0.7)) == "chat"
    assert _lands(stack, _chat(temperature="hot")) == "chat"  # not a number: the default


# -- modality -----------------------------------------------------------------------------------


def test_image_parts_go_to_the_vision_pool(stack: Stack) -> None:
    text = {"type": "text", "text": "what is in this picture?"}
    assert _lands(stack, _chat(content=[text, IMAGE_PART])) == "chat-vl"
    responses_api = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    assert _lands(stack, _chat(content=[responses_api])) == "chat-vl"
    # the first class that matches wins: an image request with a long generation is still VL
    assert _lands(stack, _chat(content=[IMAGE_PART], max_tokens=9000)) == "chat-vl"
    # an image in the inspected prefix of a body larger than the prefix
    big = _chat(content=[IMAGE_PART, {"type": "text", "text": "x" * (2 * INSPECT_BYTES)}])
    assert _lands(stack, big) == "chat-vl"


def test_text_only_requests_never_reach_the_vision_pool(stack: Stack) -> None:
    mentions = {"type": "text", "text": 'my JSON has "type": "image_url" in it'}
    assert _lands(stack, _chat(content=[mentions])) == "chat"
    assert _lands(stack, _chat(content='{"type":"image_url"}')) == "chat"
    assert _lands(stack, _chat(content=[AUDIO_PART])) == "chat"  # no audio pool configured


def test_an_image_beyond_the_inspected_prefix_takes_the_default_not_an_error(stack: Stack
                                                                             ) -> None:
    late = _chat(content=[{"type": "text", "text": "x" * (2 * INSPECT_BYTES)}, IMAGE_PART])
    assert len(json.dumps(late)) > INSPECT_BYTES
    assert _lands(stack, late) == "chat"


# -- answers when nothing can serve -------------------------------------------------------------


def _assert_openai_error(reply: Reply, status: int, code: str) -> None:
    assert reply.status == status, (reply.status, reply.raw[:300])
    assert reply.headers["content-type"] == "application/json", reply.headers
    error = reply.json["error"]
    assert error["code"] == code and error["message"] and error["type"], error


def test_no_reachable_host_answers_openai_json_with_retry_after(stack: Stack) -> None:
    reply = _send(stack, _chat("m-dead"))
    _assert_openai_error(reply, 503, "upstream_unavailable")
    assert reply.headers["retry-after"] == str(RETRY_AFTER_S)
    reply = _send(stack, _chat(model=None), {"x-model": "m-dead"})
    _assert_openai_error(reply, 503, "upstream_unavailable")


def test_a_pool_with_a_static_answer_gives_it_instead_of_a_503(stack: Stack) -> None:
    for headers, body in (({}, _chat("m-static")), ({"x-model": "m-static"}, _chat(None))):
        reply = _send(stack, body, headers)
        assert reply.status == 200 and reply.raw.decode() == STATIC_BODY, reply
        assert reply.headers["content-type"] == "application/json"
    # another pool with no healthy host keeps the JSON error: the static answer is per pool
    _assert_openai_error(_send(stack, _chat("m-dead")), 503, "upstream_unavailable")
    # a header naming another model wins over the body, as in routing
    reply = _send(stack, _chat("m-static"), {"x-model": "m-dead"})
    _assert_openai_error(reply, 503, "upstream_unavailable")


def test_route_timeout_answers_openai_json_504(stack: Stack) -> None:
    index = ROLES.index("slow")
    stack.fleet.set_response_delay(index, SLOW_TIMEOUT_S * 4)
    try:
        started = time.monotonic()
        reply = _send(stack, _chat("m-slow"))
        took = time.monotonic() - started
    finally:
        stack.fleet.set_response_delay(index, 0.0)
    _assert_openai_error(reply, 504, "upstream_timeout")
    assert "retry-after" not in reply.headers
    assert took < SLOW_TIMEOUT_S * 4, took


def test_circuit_breaker_overflow_answers_openai_json_with_retry_after(stack: Stack) -> None:
    index = ROLES.index("tight")
    stack.fleet.set_response_delay(index, 1.0)
    replies: list[Reply] = []
    lock = threading.Lock()

    def one() -> None:
        reply = _send(stack, _chat("m-tight"))
        with lock:
            replies.append(reply)

    try:
        workers = [threading.Thread(target=one) for _ in range(6)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(15)
    finally:
        stack.fleet.set_response_delay(index, 0.0)
    statuses = sorted(r.status for r in replies)
    assert len(replies) == 6 and 200 in statuses and 429 in statuses, statuses
    for reply in replies:  # over a circuit breaker: refused (429), not a dead upstream (503)
        if reply.status == 429:
            _assert_openai_error(reply, 429, "rate_limit_exceeded")
            assert reply.headers["retry-after"] == str(RETRY_AFTER_S)  # the pool has no SLO


def test_our_own_json_answers_are_left_alone(stack: Stack) -> None:
    reply = _send(stack, _chat("m-unknown"))
    _assert_openai_error(reply, 404, "model_not_found")
    assert "retry-after" not in reply.headers
    _assert_openai_error(_send(stack, _chat(model=None)), 400, "model_required")


# -- model versions -----------------------------------------------------------------------------


def _sessions(stack: Stack, headers: dict[str, str], body: dict[str, Any], count: int
              ) -> dict[str, set[str]]:
    """session id -> the backend addresses that answered its requests (4 each)."""
    homes: dict[str, set[str]] = {}
    for n in range(count):
        session = {"x-session-id": f"s-{n}", **headers}
        homes[session["x-session-id"]] = {_backend(stack, body, session) for _ in range(4)}
    return homes


def _backend(stack: Stack, body: dict[str, Any], headers: dict[str, str]) -> str:
    reply = _send(stack, body, headers)
    assert reply.status == 200 and reply.backend is not None, (reply.status, reply.raw[:200])
    return reply.backend


def test_a_version_header_goes_to_that_version_and_sessions_stay_within_it(stack: Stack
                                                                            ) -> None:
    homes = _sessions(stack, {"x-model-version": "2"}, _chat("m-ver"), 24)
    assert all(len(found) == 1 for found in homes.values()), homes  # a session sticks
    used = set().union(*homes.values())
    assert {stack.role_of(address) for address in used} == {"ver-next"}, used
    assert len(used) >= 2, used  # different sessions spread over the version's hosts
    body = _chat("m-ver", model_version="2")  # the body field works like the header
    assert _lands(stack, body) == "ver-next"
    assert _lands(stack, _chat(model=None), {"x-model": "m-ver", "x-model-version": "2"}) == \
        "ver-next"


def test_no_or_an_unknown_version_never_reaches_the_versions_pool(stack: Stack) -> None:
    for headers in ({}, {"x-model-version": "3"}, {"x-model-version": ""}):
        assert {_lands(stack, _chat("m-ver"), headers) for _ in range(10)} == {"ver"}, headers
    assert _lands(stack, _chat("m-ver", model_version="7")) == "ver"


def test_a_version_without_healthy_hosts_falls_back_to_the_pools_split(stack: Stack) -> None:
    indices = stack.indices("ver-next")
    for index in indices:
        stack.fleet.kill(index)
    try:
        wait_until(lambda: _version_hosts_healthy(stack), SETTLE_S,
                   "Envoy's health checks failing every ver-next host", check=lambda n: n == 0)
        for _ in range(20):
            assert _lands(stack, _chat("m-ver"), {"x-model-version": "2"}) == "ver"
    finally:
        for index in indices:
            stack.fleet.revive(index)
    wait_until(lambda: _version_hosts_healthy(stack), SETTLE_S, "ver-next healthy again",
               check=lambda n: n == len(indices))
    assert _lands(stack, _chat("m-ver"), {"x-model-version": "2"}) == "ver-next"


def _version_hosts_healthy(stack: Stack) -> int:
    for status in stack.envoy.clusters_json().get("cluster_statuses", []):
        if status.get("name") == "ver-next":
            return sum(1 for host in status.get("host_statuses", [])
                       if not host.get("health_status", {}).get("failed_active_health_check"))
    return -1


def test_a_body_over_the_buffer_limit_gets_a_json_413(stack: Stack) -> None:
    huge = _chat(content="x" * (9 * 1024 * 1024))
    reply = _send(stack, huge)
    _assert_openai_error(reply, 413, "request_too_large")
    assert _lands(stack, _chat()) == "chat"  # and the next request is served


def test_only_pools_with_a_modality_class_run_the_lua_filter(stack: Stack) -> None:
    def executions() -> int:
        return stack.envoy.stat("http.trimtab.lua.executions") or 0

    before = executions()
    for _ in range(3):
        assert _lands(stack, _chat("m-ver", content=[IMAGE_PART])) == "ver"
    assert executions() == before
    assert _lands(stack, _chat(content=[IMAGE_PART])) == "chat-vl"
    assert executions() == before + 1
