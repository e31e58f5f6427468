"""State-changing admin requests a browser could send from another site are refused (issue 26,
finding 2): a form or `no-cors` POST, a foreign `Origin`, a cross-site or same-site
`Sec-Fetch-Site`, with or without a token; the CLI and same-origin JSON requests still act.

The real-browser check (a page on another origin, and the status page's own buttons) is
`test_status_page.py::test_cross_origin_page_cannot_steer_a_rollout_but_the_page_can`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.admin.test_status_page import Plane, make_plane, serve
from xds_server import cli
from xds_server.admin.api import AdminApi
from xds_server.security.admin_origin import (
    MAX_QUOTED_CHARS,
    Refusal,
    RefusalLog,
    content_type_refusal,
    cross_site_refusal,
    fetch_site_refusal,
    origin_refusal,
)
from xds_server.xds.server import XdsServicer

POOL = "qwen"  # the canary pool of test_status_page.CONFIG, at 10 % when it starts
PROMOTE = f"/v1/rollouts/{POOL}/promote"
JSON = {"Content-Type": "application/json"}


def _run(body: Callable[[TestClient, Plane], Awaitable[None]], token: str | None = None) -> None:
    async def scenario() -> None:
        plane = make_plane()
        await plane.tick()
        api = AdminApi(plane.controller, lambda: True, XdsServicer(plane.controller.cache),
                       plane.nacks, plane.history, token=token)
        async with TestClient(TestServer(api.app())) as client:
            await body(client, plane)
        await plane.controller.close()
    asyncio.run(scenario())


def _percent(plane: Plane) -> float:
    return float(plane.controller.rollouts.document()[POOL]["percent"])


async def _refused(client: TestClient, plane: Plane, headers: dict[str, str],
                   data: Any = b"{}") -> dict[str, Any]:
    """POST promote with these headers; assert a JSON 403 and an unchanged rollout."""
    before = _percent(plane)
    response = await client.post(PROMOTE, data=data, headers=headers,
                                 skip_auto_headers=("Content-Type",))  # only what we set
    body = await response.json()
    assert response.status == 403, body
    assert body["error"]["status"] == 403
    assert _percent(plane) == before == 10.0
    return body["error"]


# ---- over HTTP: what a browser on another site can send is refused --------------------------

@pytest.mark.parametrize("content_type, data", [
    ("application/x-www-form-urlencoded", b"x=1"),   # <form method=post>
    ("multipart/form-data; boundary=b", b"--b--"),    # <form enctype=multipart/form-data>
    ("text/plain;charset=UTF-8", b"{}"),               # fetch(no-cors) or sendBeacon with a string
    (None, None),                                      # fetch(no-cors) without a body
])
def test_a_form_or_no_cors_post_is_refused(content_type, data):
    async def body(client: TestClient, plane: Plane) -> None:
        headers = {} if content_type is None else {"Content-Type": content_type}
        error = await _refused(client, plane, headers, data)
        assert error["header"] == "Content-Type"
        assert "needs 'Content-Type: application/json'" in error["message"]
        assert (repr(content_type) if content_type else "got none") in error["message"]
    _run(body)


@pytest.mark.parametrize("origin", [
    "http://evil.example", "http://127.0.0.1:1", "null", "http://127.0.0.1.evil.example",
    "file://", "http://user@127.0.0.1",
])
def test_a_foreign_origin_is_refused_even_with_json(origin):
    async def body(client: TestClient, plane: Plane) -> None:
        error = await _refused(client, plane, {**JSON, "Origin": origin})
        assert error["header"] == "Origin"
        assert error["message"].startswith(f"cross-site request refused: Origin {origin!r}")
        assert "127.0.0.1:" in error["message"]  # names the Host it was compared with
    _run(body)


@pytest.mark.parametrize("site", ["cross-site", "same-site", "Cross-Site", "bogus"])
def test_sec_fetch_site_other_than_same_origin_is_refused_even_with_json(site):
    async def body(client: TestClient, plane: Plane) -> None:
        error = await _refused(client, plane, {**JSON, "Sec-Fetch-Site": site})
        assert error["header"] == "Sec-Fetch-Site"
        assert f"Sec-Fetch-Site is {site!r}" in error["message"]
    _run(body)


def test_cross_site_is_refused_with_a_valid_token_too_and_401_without_one():
    async def body(client: TestClient, plane: Plane) -> None:
        auth = {"Authorization": "Bearer s3cret"}
        await _refused(client, plane, {**auth, **JSON, "Origin": "http://evil.example"})
        await _refused(client, plane, {**auth, "Content-Type": "text/plain"})
        missing = await client.post(PROMOTE, headers={**JSON, "Origin": "http://evil.example"})
        assert missing.status == 401  # the token is checked first
        ok = await client.post(PROMOTE, headers={**auth, **JSON})
        assert ok.status == 200, await ok.text()
        assert _percent(plane) == 100.0
    _run(body, token="s3cret")


# ---- what still acts ---------------------------------------------------------------------------

def test_a_same_origin_json_post_acts_as_the_status_page_sends_it():
    async def body(client: TestClient, plane: Plane) -> None:
        host = f"127.0.0.1:{client.port}"
        response = await client.post(f"/v1/rollouts/{POOL}/pause", data=b"{}", headers={
            "Content-Type": "application/json; charset=utf-8", "Origin": f"http://{host}",
            "Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"})
        assert response.status == 200, await response.text()
        assert (await response.json())["phase"] == "paused"
        response = await client.post(PROMOTE, headers={**JSON, "Origin": f"HTTP://{host.upper()}"})
        assert response.status == 200, await response.text()
        assert _percent(plane) == 100.0
    _run(body)


def test_reads_are_not_affected():
    async def body(client: TestClient, plane: Plane) -> None:
        response = await client.get("/v1/rollouts", headers={"Origin": "http://evil.example",
                                                              "Sec-Fetch-Site": "cross-site"})
        assert response.status == 200
    _run(body)


def test_the_cli_steers_a_rollout(capsys):
    plane = make_plane()
    with serve(_app(plane)) as (base, loop):
        asyncio.run_coroutine_threadsafe(plane.tick(), loop).result(10)
        args = cli.build_parser().parse_args(["rollout", "promote", POOL, "--admin", base])
        assert cli.cmd_rollout(args) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["percent"] == 100.0
        assert _percent(plane) == 100.0
        asyncio.run_coroutine_threadsafe(plane.controller.close(), loop).result(10)


def _app(plane: Plane) -> Any:
    return AdminApi(plane.controller, lambda: True, XdsServicer(plane.controller.cache),
                    plane.nacks, plane.history).app()


# ---- the rule itself ----------------------------------------------------------------------------

def test_origin_rule_compares_host_and_port_with_the_host_header():
    same = [("http://127.0.0.1:19100", "127.0.0.1:19100"), ("http://[::1]:19100", "[::1]:19100"),
            ("http://Admin.Example", "admin.example:80"), ("https://admin.example", "admin.example"),
            ("https://admin.example:443", "admin.example")]
    for origin, host in same:
        assert origin_refusal([origin], host) is None, (origin, host)
    other = [("http://127.0.0.1:19101", "127.0.0.1:19100"), ("http://localhost:19100", "127.0.0.1:19100"),
             ("http://admin.example", "admin.example:8080"), ("ftp://admin.example", "admin.example"),
             ("http://admin.example/x", "admin.example"), ("http://admin.example:x", "admin.example"),
             ("http://127.0.0.1:19100", "127.0.0.1:bad"), ("http://[::1", "[::1]:80")]
    for origin, host in other:
        refusal = origin_refusal([origin], host)
        assert refusal is not None and refusal.header == "Origin", (origin, host)
    assert origin_refusal([], "anything") is None
    two = origin_refusal(["http://a", "http://a"], "a")
    assert two is not None and "2 Origin headers" in two.message
    missing_host = origin_refusal(["http://a"], None)
    assert missing_host is not None and "no Host header" in missing_host.message


def test_fetch_site_and_content_type_rules():
    assert fetch_site_refusal(None) is None
    assert fetch_site_refusal("same-origin") is None and fetch_site_refusal("none") is None
    assert fetch_site_refusal("same-site") is not None
    assert content_type_refusal("application/json") is None
    assert content_type_refusal("Application/JSON ; charset=utf-8") is None
    for bad in (None, "", "text/plain", "application/jsonx", "application/x-www-form-urlencoded"):
        assert content_type_refusal(bad) is not None, bad


def test_safe_methods_pass_and_every_other_method_is_checked():
    for method in ("GET", "HEAD", "OPTIONS", "get"):
        assert cross_site_refusal(method, {"Sec-Fetch-Site": "cross-site"}, []) is None
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert cross_site_refusal(method, {}, []) == content_type_refusal(None)
        assert cross_site_refusal(method, JSON, []) is None


def test_a_peer_header_is_quoted_bounded_and_escaped_in_the_error():
    huge = "http://evil.example/" + "\n\x1b[31m" * 10_000
    refusal = origin_refusal([huge], "127.0.0.1:1")
    assert refusal is not None
    assert len(refusal.message) < MAX_QUOTED_CHARS * 2 + 200
    assert "\n" not in refusal.message and "\x1b" not in refusal.message
    assert f"({len(huge)} chars)" in refusal.message


def test_refusals_are_logged_at_most_once_a_minute_with_the_count(caplog):
    now = [0.0]
    refusals = RefusalLog(every=60.0, clock=lambda: now[0])

    class Request:
        method, path, remote = "POST", "/v1/rollouts/p/promote\n", "127.0.0.1"

    refusal = Refusal("Origin", "cross-site request refused: Origin 'x'")
    with caplog.at_level(logging.WARNING, logger="trimtab.admin"):
        for step in range(5):
            now[0] = step * 20.0  # 0, 20, 40, 60, 80 s
            refusals.note(Request(), refusal)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused 1 cross-site admin request(s)")
    assert lines[1].startswith("refused 3 cross-site admin request(s)")  # 20, 40 and 60 s
    assert all("\n" not in line and "promote\\n" in line for line in lines)
