"""Redirects are never followed (issue 26 §6): a metrics page or Prometheus answering 302 to
another server is unread, and the other server is never asked."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from tests.support.paths import METRICS_FIXTURES
from xds_server.telemetry.promql import PromQLResult, PromQLSource
from xds_server.telemetry.scrape import Scraper, ScrapeResult

NOW = 1_700_000_000.0
PAGE = (METRICS_FIXTURES / "vllm_with_dcgm.txt").read_text()
ANSWER = ('{"status":"success","data":{"resultType":"vector","result":[{"metric":'
          '{"instance":"10.0.0.1:8000"},"value":[1,"0.25"]}]}}')


async def _serve(path: str, handler: Callable[[web.Request], Awaitable[web.Response]]
                 ) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def _target_and_redirector(path: str, body: str, content_type: str, status: int = 302
                                 ) -> tuple[list[web.AppRunner], str, str, list[str]]:
    """A server whose ``path`` would be a usable answer, and one that redirects there:
    (runners, the redirecting server's base URL, the target URL, paths the target served)."""
    asked: list[str] = []

    async def target(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(text=body, content_type=content_type)

    target_runner, target_port = await _serve(path, target)
    location = f"http://127.0.0.1:{target_port}{path}"

    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=status, headers={"Location": location})

    redirect_runner, redirect_port = await _serve(path, redirect)
    return ([target_runner, redirect_runner], f"http://127.0.0.1:{redirect_port}", location,
            asked)


def test_a_scraped_page_that_redirects_is_unread_and_its_target_never_fetched() -> None:
    async def scenario() -> tuple[dict[str, ScrapeResult], str, list[str]]:
        runners, base, location, asked = await _target_and_redirector(
            "/metrics", PAGE, "text/plain")
        scraper = Scraper(timeout_seconds=2.0)
        try:
            results = await scraper.scrape({"10.0.0.1:8000": f"{base}/metrics"}, now=lambda: NOW)
            return results, location, asked
        finally:
            await scraper.close()
            for runner in runners:
                await runner.cleanup()

    results, location, asked = asyncio.run(scenario())
    result = results["10.0.0.1:8000"]
    assert result.signals is None
    assert result.error == (f"redirect: metrics page answered 302 redirect to {location}; "
                            f"trimtab does not follow redirects")
    assert asked == []


def test_a_prometheus_that_redirects_fails_the_query_and_its_target_is_never_asked() -> None:
    async def scenario() -> tuple[PromQLResult, str, list[str]]:
        runners, base, location, asked = await _target_and_redirector(
            "/api/v1/query", ANSWER, "application/json", status=307)
        source = PromQLSource(base, queries={"kv_usage": "up"})
        try:
            return await source.fetch(), location, asked
        finally:
            await source.close()
            for runner in runners:
                await runner.cleanup()

    result, location, asked = asyncio.run(scenario())
    assert result.values == {}
    assert result.errors == {"kv_usage": f"redirect: Prometheus answered 307 redirect to "
                                         f"{location}; trimtab does not follow redirects"}
    assert asked == []


def test_a_peer_location_is_shown_bounded_and_escaped() -> None:
    from xds_server.telemetry.redirects import MAX_SHOWN_LOCATION_CHARS, shown_location

    assert shown_location({}) == "(none)"
    assert shown_location({"Location": "http://a/\r\nX-Evil: 1\x1b[31m"}) == \
        "http://a/\\r\\nX-Evil: 1\\x1b[31m"
    long = "http://a/" + "x" * 10_000
    shown = shown_location({"Location": long})
    assert shown.startswith(long[:MAX_SHOWN_LOCATION_CHARS])
    assert shown.endswith(f"... ({len(long)} characters)")
    assert len(shown) < MAX_SHOWN_LOCATION_CHARS + 40
