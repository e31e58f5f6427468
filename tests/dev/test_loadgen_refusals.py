"""Refusals in the load generator: a 429 is recorded as a refusal (not an error) with its
answer time, its OpenAI shape and its Retry-After, against a tiny aiohttp server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any

import pytest
from aiohttp import web

from trimtab_dev.loadgen.refusals import openai_error, retry_after_seconds
from trimtab_dev.loadgen.report import summarize
from trimtab_dev.loadgen.runner import RequestRecord, RunResult, run_load
from trimtab_dev.loadgen.workload import parse_workload

OPENAI_429 = {"error": {"message": "over budget, retry later", "type": "rate_limit_exceeded",
                        "code": "rate_limit_exceeded"}}
WORKLOAD: dict[str, Any] = {
    "name": "r", "seed": 1, "rate": 50, "duration_s": 0.2, "endpoint": "chat", "stream": True,
    "tenants": {"header": "x-tenant", "count": 2},
    "classes": [{"name": "chat", "weight": 1, "prompt_tokens": {"dist": "fixed", "value": 10},
                 "max_tokens": {"dist": "fixed", "value": 2}}],
}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _run(handler: Handler) -> list[RequestRecord]:
    async def main() -> list[RequestRecord]:
        runner, url = await _serve(handler)
        try:
            return (await run_load([url], parse_workload(WORKLOAD))).records
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_an_openai_429_with_retry_after_is_a_refusal() -> None:
    seen: list[str | None] = []

    async def refuse(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("x-tenant"))
        return web.json_response(OPENAI_429, status=429, headers={"Retry-After": "2"})

    records = _run(refuse)
    assert records and len(seen) == len(records)
    assert {r.tenant for r in records} == set(seen) and set(seen) <= {"t0", "t1"}
    for r in records:
        assert r.refused and not r.served and r.error is None and r.status == 429
        assert r.openai_error is True and r.error_code == "rate_limit_exceeded"
        assert r.retry_after == "2" and r.retry_after_s == 2.0
        assert r.e2e is not None and 0 <= r.e2e < 5 and r.ttft is None
    report = summarize(RunResult(records, 50, 0.2, 1.0, ["x"], 0.0))
    assert report["requests"]["refused"] == len(records)
    assert report["requests"]["errors"] == 0 and report["errors"]["count"] == 0
    assert report["refusals"]["openai_shaped_with_retry_after"] == len(records)
    assert report["refusals"]["latency_s"]["count"] == len(records)
    assert report["ttft_s"]["count"] == 0
    assert sum(t["refused"] for t in report["per_tenant"].values()) == len(records)


def test_a_bare_429_is_a_refusal_without_shape_or_retry_after() -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.Response(status=429, text="slow down")

    records = _run(refuse)
    assert records and all(r.refused and r.error is None for r in records)
    assert all(r.openai_error is False and r.retry_after is None and r.retry_after_s is None
               for r in records)
    refusals = summarize(RunResult(records, 50, 0.2, 1.0, ["x"], 0.0))["refusals"]
    assert refusals["count"] == len(records) and refusals["openai_shaped"] == 0
    assert refusals["with_retry_after"] == 0


def test_a_503_stays_an_error_and_a_200_is_served() -> None:
    async def unavailable(request: web.Request) -> web.StreamResponse:
        return web.json_response(OPENAI_429, status=503, headers={"Retry-After": "1"})

    records = _run(unavailable)
    assert records and all(r.error == "http_503" and not r.refused for r in records)
    assert all(r.openai_error is True and r.retry_after_s == 1.0 for r in records)

    async def serve(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b"):
            chunk = {"choices": [{"delta": {"content": text}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    served = _run(serve)
    assert served and all(r.served and r.ttft is not None for r in served)
    assert all(r.openai_error is None and r.retry_after is None for r in served)


@pytest.mark.parametrize("body, expected", [
    (OPENAI_429, (True, "rate_limit_exceeded", "rate_limit_exceeded")),
    ({"error": {"message": "m", "type": "t", "code": None}}, (True, "t", None)),
    ({"error": {"message": "m", "type": "t", "code": 429}}, (True, "t", "429")),
    ({"error": {"message": "m", "type": "t"}}, (False, "t", None)),  # no code key
    ({"error": {"message": "", "type": "t", "code": "c"}}, (False, "t", "c")),
    ({"error": "rate limited"}, (False, None, None)),
    ({"message": "m", "type": "t", "code": "c"}, (False, None, None)),
    ([1, 2], (False, None, None)),
])
def test_openai_error_shape(body: Any, expected: tuple[bool, str | None, str | None]) -> None:
    assert openai_error(json.dumps(body).encode()) == expected


def test_openai_error_of_a_body_that_is_not_json() -> None:
    assert openai_error(b"upstream connect error") == (False, None, None)
    assert openai_error(b"\xff\xfe") == (False, None, None)


def test_retry_after_values() -> None:
    now = time.time()
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(" 0.5 ") == 0.5
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("") is None
    assert retry_after_seconds("-1") is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("nan") is None
    later = retry_after_seconds(formatdate(now + 30, usegmt=True), now=now)
    assert later is not None and 28 <= later <= 31
    assert retry_after_seconds(formatdate(now - 30, usegmt=True), now=now) == 0.0
