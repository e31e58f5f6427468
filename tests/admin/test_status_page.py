"""The status page: weight history, static assets, and the live page in a real headless Chromium.

The browser test serves the admin app (AdminApi + the status routes) on a real TCP port from a
background event loop, ticks a Controller fed by a fake scraper, and checks that the page shows
the weights `/v1/weights` holds, follows a weight change without a reload, and loads nothing from
any other origin.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from tests.control.test_controller import FakeScraper
from tests.support.wait import wait_until
from weight_calculator.admission import PoolBudget
from xds_server.admin.api import AdminApi
from xds_server.admin.documents import weights_document
from xds_server.admin.history import WeightHistory
from xds_server.admin.status_page import add_status_routes, read_asset
from xds_server.config.load import parse_config
from xds_server.control.admission import AdmissionState
from xds_server.control.controller import Controller
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache
from xds_server.xds.lrs import ClusterLoad, EndpointLoad, EnvoyLoad, Report
from xds_server.xds.nacks import NackLog
from xds_server.xds.protocol import Nack, SotwStream
from xds_server.xds.server import XdsServicer
from xds_server.xds.stream_info import StreamInfo

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

CONFIG = parse_config({
    "telemetry": {"interval_seconds": 2, "stale_after_seconds": 6},
    "weights": {"policy": "gpu_memory"},  # the seed's formula: weights follow gpu_mem_pct
    "pools": [
        {"name": "llama", "model": "meta-llama/Llama-3.1-8B-Instruct", "endpoints": [
            {"address": "10.0.0.1:80"}, {"address": "10.0.0.2:80"}, {"address": "10.0.0.3:80"}]},
        {"name": "qwen", "model": "Qwen/Qwen2.5-7B", "versions": {
            "stable": {"endpoints": [{"address": "10.0.1.1:80"}]},
            "canary": {"endpoints": [{"address": "10.0.1.2:80"}]}}},
    ],
})
START_PCT = {"10.0.0.1:80": 20.0, "10.0.0.2:80": 50.0, "10.0.0.3:80": 90.0,
             "10.0.1.1:80": 30.0, "10.0.1.2:80": 10.0}


@dataclass
class Plane:
    """A controller with a fake scraper and a fake clock, plus what the admin app shows."""

    controller: Controller
    scraper: FakeScraper
    history: WeightHistory
    nacks: NackLog
    clock: list[float] = field(default_factory=lambda: [1000.0])
    load: EnvoyLoad = field(default_factory=EnvoyLoad)  # Envoy's load reports (LRS)

    async def tick(self, pct: dict[str, float | None] | None = None) -> None:
        """One tick, 2 s after the last, with these GPU memory percentages (None: the scrape
        fails), recorded in the history the way the lead wires it."""
        self.scraper.pct.update(pct or {})
        self.clock[0] += 2.0
        await self.controller.tick()
        self.history.record(self.controller.clock(), weights_document(self.controller))

    def app(self) -> web.Application:
        api = AdminApi(self.controller, lambda: True, XdsServicer(self.controller.cache), self.nacks,
                       load=self.load)
        app = api.app()
        add_status_routes(app, self.history)
        return app


def make_plane() -> Plane:
    scraper = FakeScraper()
    scraper.pct = dict(START_PCT)
    clock = [1000.0]
    controller = Controller(CONFIG, SnapshotCache(), scraper=scraper,  # type: ignore[arg-type]
                            clock=lambda: clock[0])
    plane = Plane(controller, scraper, WeightHistory(max_points=50), NackLog(clock=lambda: clock[0]),
                  clock)
    return plane


def add_admission(plane: Plane) -> None:
    """A budget in force for llama (22 in flight over 2 Envoys) and one Envoy's load report
    on it: 11 admitted and 4 refused in the last second, 11 in flight."""
    plane.controller.admission = AdmissionState(
        budgets={"llama": PoolBudget(in_flight=22, serving=16, retry_after_s=1.0)},
        envoys={"llama": 2})
    key = plane.load.open()
    plane.load.add(key, Report({"llama": ClusterLoad(11, 4, 11, 1.0, {
        "10.0.0.1:80": EndpointLoad(8, 0, 8), "10.0.0.2:80": EndpointLoad(3, 0, 3),
        "10.0.0.3:80": EndpointLoad(0, 6, 0)})}), {"llama"})


# what add_admission's report says per endpoint, as /v1/admission shows it: 10.0.0.3 is dead
ENDPOINT_LOAD = {
    "10.0.0.1:80": {"issued_per_s": 8.0, "errors_per_s": 0.0, "in_progress": 8, "reporting": 1},
    "10.0.0.2:80": {"issued_per_s": 3.0, "errors_per_s": 0.0, "in_progress": 3, "reporting": 1},
    "10.0.0.3:80": {"issued_per_s": 0.0, "errors_per_s": 6.0, "in_progress": 0, "reporting": 1}}


def add_nack(plane: Plane, detail: str) -> None:
    machine = SotwStream()
    info = StreamInfo("ipv4:127.0.0.1:5000", "sotw", "ADS", machine)
    plane.nacks.observe(info, Nack(T.ENDPOINT, "7", "v1", detail, {"llama": "abcdef0123456789"}))


# ---- WeightHistory ----------------------------------------------------------------------------

def _doc(stale: tuple[str, ...] = (), **weights: int) -> dict[str, Any]:
    return {"pools": {"p": {a: {"weight": w, "stale": a in stale} for a, w in weights.items()}}}


def test_history_is_a_bounded_ring_with_since_queries():
    history = WeightHistory(max_points=3)
    for i in range(5):
        history.record(100.0 + i, _doc(a=10 + i))
    doc = history.document()
    assert [p["at"] for p in doc["points"]] == [102.0, 103.0, 104.0]
    assert doc["points"][-1] == {"at": 104.0, "weights": {"p": {"a": 14}}, "stale": {}}
    assert (doc["max_points"], doc["oldest_at"], doc["latest_at"]) == (3, 102.0, 104.0)
    assert [p["at"] for p in history.document(since=103.0)["points"]] == [104.0]
    assert history.document(since=104.0)["points"] == []


def test_history_keeps_which_endpoints_were_stale():
    history = WeightHistory()
    history.record(1.0, _doc(stale=("b",), a=5, b=1))
    history.record(2.0, _doc(a=5, b=3))
    assert [p["stale"] for p in history.document()["points"]] == [{"p": ["b"]}, {}]


def test_history_same_time_replaces_and_backwards_clock_restarts():
    history = WeightHistory(max_points=10)
    history.record(5.0, _doc(a=1))
    history.record(6.0, _doc(a=2))
    history.record(6.0, _doc(a=3))
    assert [(p["at"], p["weights"]["p"]["a"]) for p in history.document()["points"]] == [
        (5.0, 1), (6.0, 3)]
    history.record(1.0, _doc(a=4))
    assert [p["at"] for p in history.document()["points"]] == [1.0]


def test_history_sizing_and_empty_document():
    assert WeightHistory.for_interval(2.0).max_points == 300
    assert WeightHistory.for_interval(0.7, window_seconds=7).max_points == 10
    assert WeightHistory().document() == {"max_points": 300, "oldest_at": None,
                                          "latest_at": None, "points": []}
    with pytest.raises(ValueError):
        WeightHistory(max_points=0)


# ---- routes over HTTP (no browser) ------------------------------------------------------------

async def _with_client(body) -> None:
    plane = make_plane()
    async with TestClient(TestServer(plane.app())) as client:
        await body(client, plane)


def test_static_assets_have_content_types_and_a_strict_csp():
    async def body(client: TestClient, plane: Plane) -> None:
        for path, ctype in [("/", "text/html"), ("/static/index.html", "text/html"),
                            ("/static/app.js", "text/javascript"), ("/static/style.css", "text/css")]:
            response = await client.get(path)
            assert response.status == 200, path
            assert response.content_type == ctype, path
            assert "default-src 'none'" in response.headers["Content-Security-Policy"]
            assert response.headers["X-Content-Type-Options"] == "nosniff"
        html = await (await client.get("/")).text()
        links = re.findall(r'(?:src|href)="([^"]*)"', html)
        assert "/static/app.js" in links and "/static/style.css" in links
        assert all(link.startswith("/") or link == "data:," for link in links), links
    asyncio.run(_with_client(body))


def test_assets_reference_no_other_origin():
    for name in ("index.html", "app.js", "style.css"):
        text = (read_asset(name) or b"").decode()
        assert text, name
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'`)]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)  # an XML namespace, not a fetch


@pytest.mark.parametrize("raw_path", [
    "/static/..%2Fadmin.py", "/static/%2e%2e%2fhistory.py", "/static/..%5Chistory.py",
    "/static/.hidden.js", "/static/history.py", "/static/nope.js", "/static/app.js%00.css",
    "/static/../history.py",
])
def test_static_refuses_traversal_and_unknown_names_with_json_404(raw_path):
    async def body(client: TestClient, plane: Plane) -> None:
        response = await client.get(URL(raw_path, encoded=True))
        text = await response.text()
        assert response.status == 404, (raw_path, text)
        assert json.loads(text)["error"]["status"] == 404
        assert "import" not in text
    asyncio.run(_with_client(body))


def test_read_asset_rejects_unsafe_names():
    assert read_asset("app.js") is not None
    for name in ("../history.py", "..", "static/app.js", "/etc/passwd", "app.js/", "a..js", ""):
        assert read_asset(name) is None, name


def test_history_endpoint_shape_and_since():
    async def body(client: TestClient, plane: Plane) -> None:
        await plane.tick()
        await plane.tick({"10.0.0.1:80": 60.0})
        doc = await (await client.get("/v1/history")).json()
        assert set(doc) == {"max_points", "oldest_at", "latest_at", "points"}
        assert [p["at"] for p in doc["points"]] == [1002.0, 1004.0]
        assert [p["stale"] for p in doc["points"]] == [{}, {}]
        last = doc["points"][-1]["weights"]
        weights = (await (await client.get("/v1/weights")).json())["pools"]
        assert last == {pool: {a: e["weight"] for a, e in eps.items()} for pool, eps in weights.items()}
        assert doc["points"][0]["weights"]["llama"]["10.0.0.1:80"] == 90
        assert last["llama"]["10.0.0.1:80"] == 70
        later = await (await client.get("/v1/history?since=1002")).json()
        assert [p["at"] for p in later["points"]] == [1004.0]
        for bad in ("abc", "nan", "inf"):
            response = await client.get(f"/v1/history?since={bad}")
            assert response.status == 400 and (await response.json())["error"]["status"] == 400
    asyncio.run(_with_client(body))


def test_admission_document_has_the_budget_in_force_and_envoys_load_reports():
    async def body(client: TestClient, plane: Plane) -> None:
        await plane.tick()
        add_admission(plane)
        doc = (await (await client.get("/v1/admission")).json())["pools"]
        llama = doc["llama"]["clusters"]["llama"]
        assert llama["budget"] == 22 and llama["envoys"] == 2
        assert llama["limit"] == {"interactive": 11, "batch": 6}  # ceil(22 / 2), half for batch
        assert llama["envoy"] == {"issued": 11, "dropped": 4, "in_progress": 11,
                                  "issued_per_s": 11.0, "dropped_per_s": 4.0, "reporting": 1,
                                  "endpoints": ENDPOINT_LOAD}
        qwen = doc["qwen"]["clusters"]
        assert set(qwen) == {"qwen", "qwen-canary"}
        assert qwen["qwen"]["budget"] is None and qwen["qwen"]["envoy"] is None
        metrics = await (await client.get("/metrics")).text()
        assert 'trimtab_envoy_requests_total{cluster="llama",outcome="dropped"} 4.0' in metrics
        assert 'trimtab_envoy_requests_in_progress{cluster="llama"} 11.0' in metrics
    asyncio.run(_with_client(body))


# ---- the live page in headless Chromium ---------------------------------------------------------

@contextmanager
def serve(app: web.Application) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    """Serve `app` on a free loopback port from an event loop in a background thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="status-page-server", daemon=True)
    thread.start()
    runner = web.AppRunner(app, access_log=None)
    try:
        run_on(loop, runner.setup())
        run_on(loop, web.TCPSite(runner, "127.0.0.1", 0).start())
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", loop
    finally:
        run_on(loop, runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


@contextmanager
def chromium() -> Iterator[Any]:
    """Headless Chromium through the system chromedriver: no browser download, no selenium-manager
    (an explicit driver path skips it; SE_OFFLINE=true is belt and braces)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="trimtab-chromium-") as profile, \
            pytest.MonkeyPatch.context() as env:
        env.setenv("SE_OFFLINE", "true")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                    f"--user-data-dir={profile}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            driver.set_script_timeout(10)
            yield driver
        finally:
            driver.quit()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


PAGE_STATE_JS = """
const out = {rows: {}, shares: {}, localities: {}, paths: {}, points: {}, stale: [], bands: [],
             rollouts: {}, nacks: []};
for (const s of document.querySelectorAll('section.pool')) {
  const pool = s.dataset.pool;
  for (const tr of s.querySelectorAll('tbody tr[data-endpoint]')) {
    out.rows[pool + '/' + tr.dataset.endpoint] = Number(tr.querySelector('.weight').dataset.weight);
    out.shares[pool + '/' + tr.dataset.endpoint] = Number(tr.querySelector('.share').dataset.share);
    out.localities[pool + '/' + tr.dataset.endpoint] = tr.querySelector('.locality').textContent;
    if (tr.classList.contains('row-stale')) out.stale.push(pool + '/' + tr.dataset.endpoint);
  }
  for (const p of s.querySelectorAll('svg.chart path.series')) {
    out.paths[pool + '/' + p.dataset.endpoint] = {weight: Number(p.dataset.weight),
                                                  steps: (p.getAttribute('d').match(/H/g) || []).length};
  }
  for (const b of s.querySelectorAll('svg.chart path.stale-band'))
    out.bands.push(pool + '/' + b.dataset.endpoint);
  for (const c of s.querySelectorAll('svg.chart circle.last-point'))
    out.points[pool + '/' + c.dataset.endpoint] = Number(c.dataset.weight);
}
for (const tr of document.querySelectorAll('#rollouts tbody tr[data-pool]'))
  out.rollouts[tr.dataset.pool] = Number(tr.dataset.percent);
for (const tr of document.querySelectorAll('#nacks tbody tr.nack'))
  out.nacks.push(tr.textContent + ' ' + tr.nextElementSibling.textContent);
return out;
"""


def expected_weights(base: str) -> dict[str, int]:
    doc = get_json(f"{base}/v1/weights")
    return {f"{pool}/{a}": e["weight"] for pool, eps in doc["pools"].items() for a, e in eps.items()}


def wait_for_page(driver: Any, predicate, timeout: float = 8.0) -> dict[str, Any]:
    """Poll the page's DOM until `predicate(state)` holds; returns that state."""
    return wait_until(lambda: driver.execute_script(PAGE_STATE_JS), timeout, "the page's state",
                      check=predicate, every=0.1)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM) or not os.path.exists(CHROMEDRIVER),
                    reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)")
def test_live_page_shows_the_weights_held_and_follows_changes():
    pytest.importorskip("selenium", reason="needs selenium (the dev extra)")
    plane = make_plane()
    add_nack(plane, "Proto constraint validation failed: load_balancing_weight: value must be >= 1")
    with serve(plane.app()) as (base, loop):
        for pct in (20.0, 40.0, 60.0):
            run_on(loop, plane.tick({"10.0.0.1:80": pct}))
        run_on(loop, plane.tick({"10.0.0.3:80": None}))  # its scrape fails: stale
        with chromium() as driver:
            driver.get(f"{base}/")
            want = expected_weights(base)
            page = wait_for_page(driver, lambda p: p["rows"] == want and p["paths"].keys() == want.keys())
            if os.environ.get("TRIMTAB_SCREENSHOT"):
                driver.save_screenshot(os.environ["TRIMTAB_SCREENSHOT"])
            assert page["rows"] == want
            assert {k: v["weight"] for k, v in page["paths"].items()} == want
            assert page["points"] == want
            assert {v["steps"] for v in page["paths"].values()} == {3}  # 4 ticks: a line of 4 points
            assert want["llama/10.0.0.1:80"] == 70 and page["stale"] == ["llama/10.0.0.3:80"]
            llama = get_json(f"{base}/v1/weights")["pools"]["llama"]
            assert {a: page["shares"][f"llama/{a}"] for a in llama} == {
                a: pytest.approx(100 * e["share"]) for a, e in llama.items()}
            rollouts = get_json(f"{base}/v1/rollouts")["rollouts"]
            assert page["rollouts"] == {"qwen": rollouts["qwen"]["percent"]} != {}
            assert len(page["nacks"]) == 1 and "load_balancing_weight" in page["nacks"][0]
            add_admission(plane)
            lines = wait_until(lambda: driver.execute_script(
                "return [...document.querySelectorAll('section.pool .pool-admission .admission')]"
                ".map(e => e.textContent);"), 8.0, "the admission lines",
                check=lambda t: any("budget 22" in line for line in t), every=0.1)
            assert ("llama: budget 22 in flight · 11 per Envoy (batch 6) × 2 Envoys · Envoy: "
                    "11/s admitted, 4/s refused, 11 in flight (11 / 4 in all)") in lines, lines
            assert any(line.startswith("qwen-canary: no budget") for line in lines), lines
            envoy = wait_until(lambda: driver.execute_script(
                "return Object.fromEntries([...document.querySelectorAll("
                "'section.pool[data-pool=llama] td.envoy')].map(td => "
                "[td.parentElement.dataset.endpoint, [td.dataset.envoy, td.textContent]]));"),
                8.0, "Envoy's per-endpoint counts", check=lambda e: e.get("10.0.0.1:80", [""])[0] == "ok",
                every=0.1)
            assert envoy == {"10.0.0.1:80": ["ok", "8/s · 8 in flight"],
                             "10.0.0.2:80": ["ok", "3/s · 3 in flight"],
                             "10.0.0.3:80": ["errors", "0/s · 0 in flight · 6/s errors"]}, envoy

            driver.execute_script("window.__sameDocument = true;")
            run_on(loop, plane.tick({"10.0.0.2:80": 96.0}))
            want = expected_weights(base)
            assert want["llama/10.0.0.2:80"] == 52
            page = wait_for_page(driver, lambda p: p["rows"] == want and p["points"] == want)
            assert page["rows"] == want and page["points"] == want
            assert page["paths"]["llama/10.0.0.2:80"] == {"weight": 52, "steps": 4}
            assert page["bands"] == ["llama/10.0.0.3:80"]  # stale from the 4th tick on
            assert driver.execute_script("return window.__sameDocument === true;")  # no reload

            urls = driver.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)"
                ".concat(performance.getEntriesByType('navigation').map(e => e.name));")
            assert any(u.endswith("/static/app.js") for u in urls)
            assert any("/v1/history?since=" in u for u in urls)  # incremental polling
            assert [u for u in urls if not u.startswith(base + "/")] == []


# ---- cross-site commands in headless Chromium (issue 26, finding 2) ------------------------------

ATTACK_PAGE = """<!doctype html><html><body><form id="f" method="POST" target="sink" action="{url}">
<input name="x" value="1"></form><script>
(async () => {{
  const url = "{url}";
  const results = [];
  for (const init of [{{method: "POST", mode: "no-cors"}},
                      {{method: "POST", mode: "no-cors", body: "{{}}"}},
                      {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body: "{{}}"}}]) {{
    try {{ results.push((await fetch(url, init)).type); }} catch (e) {{ results.push("error " + e); }}
  }}
  try {{  // what the page's own buttons send, from here: the CORS preflight fails
    await fetch(url, {{method: "POST", headers: {{"Content-Type": "application/json"}}, body: "{{}}"}});
    results.push("json sent");
  }} catch (e) {{ results.push("json blocked"); }}
  const frame = document.createElement("iframe");
  frame.name = "sink";
  document.body.append(frame);
  await new Promise((resolve) => {{ frame.onload = resolve; document.getElementById("f").submit(); }});
  document.body.dataset.results = JSON.stringify(results);
}})();
</script></body></html>"""


def recording(app: web.Application) -> list[tuple[str, str, int]]:
    """(method, Sec-Fetch-Site, status) of every request `app` answers, from its outermost
    middleware: what the browser actually sent, whatever the page reports."""
    seen: list[tuple[str, str, int]] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        response = await handler(request)
        seen.append((request.method, request.headers.get("Sec-Fetch-Site", ""), response.status))
        return response

    app.middlewares.insert(0, record)
    return seen


def rollout_of(base: str, pool: str) -> dict[str, Any]:
    return get_json(f"{base}/v1/rollouts")["rollouts"][pool]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM) or not os.path.exists(CHROMEDRIVER),
                    reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)")
def test_cross_origin_page_cannot_steer_a_rollout_but_the_page_can():
    pytest.importorskip("selenium", reason="needs selenium (the dev extra)")
    from selenium.webdriver.common.by import By

    plane = make_plane()
    app = plane.app()
    seen = recording(app)
    with serve(app) as (base, loop):
        run_on(loop, plane.tick())
        assert rollout_of(base, "qwen")["percent"] == 10.0
        target = f"{base}/v1/rollouts/qwen/promote"

        async def attack_page(request: web.Request) -> web.Response:
            return web.Response(text=ATTACK_PAGE.format(url=target), content_type="text/html")

        attacker = web.Application()
        attacker.router.add_get("/", attack_page)
        with serve(attacker) as (other, _), chromium() as driver:
            assert other != base
            driver.get(f"{other}/")
            results = wait_until(lambda: driver.execute_script(
                "return document.body.dataset.results || null;"), 10, "the attack page's requests")
            posts = wait_until(lambda: [s for s in seen if s[0] == "POST"], 5, "the form's POST",
                               check=lambda p: len(p) == 4)
            assert json.loads(results) == ["opaque", "opaque", "opaque", "json blocked"]
            assert posts == [("POST", "same-site", 403)] * 4, posts  # 127.0.0.1 on another port
            assert ("OPTIONS", "same-site", 405) in seen  # the preflight, refused
            after = rollout_of(base, "qwen")
            assert (after["phase"], after["percent"]) == ("progressing", 10.0)

            seen.clear()
            driver.get(f"{base}/")
            pause = wait_until(lambda: driver.find_elements(
                By.CSS_SELECTOR, '#rollouts button[data-pool="qwen"][data-action="pause"]'), 8,
                "the pause button")
            pause[0].click()
            wait_until(lambda: rollout_of(base, "qwen")["phase"], 5, "paused", check="paused".__eq__)
            promote = wait_until(lambda: driver.find_elements(
                By.CSS_SELECTOR, '#rollouts button[data-pool="qwen"][data-action="promote"]'), 5,
                "the promote button")
            promote[0].click()
            driver.switch_to.alert.accept()  # "Promote qwen: send all of its traffic to the canary?"
            wait_until(lambda: rollout_of(base, "qwen")["percent"], 5, "promoted", check=(100.0).__eq__)
            page = wait_for_page(driver, lambda p: p["rollouts"] == {"qwen": 100})
            assert page["rollouts"] == {"qwen": 100}
            assert "promote qwen: promoted at 100%" in driver.find_element(By.ID, "rollout-result").text
            assert [s for s in seen if s[0] == "POST"] == [("POST", "same-origin", 200)] * 2


def test_weights_document_gives_each_endpoint_its_share_of_its_cluster():
    """Issue 25 item 3: the page shows `share`, Envoy's split of the cluster's new requests
    (weight_calculator.localities.document_shares), per cluster: a canary cluster's shares
    add up to 1 on their own."""
    plane = make_plane()
    asyncio.run(plane.tick())
    pools = weights_document(plane.controller)["pools"]
    llama = pools["llama"]
    total = sum(e["weight"] for e in llama.values())
    assert {a: e["share"] for a, e in llama.items()} == {
        a: pytest.approx(e["weight"] / total, abs=1e-4) for a, e in llama.items()}
    assert [e["share"] for e in pools["qwen"].values()] == [1.0, 1.0]  # stable, canary
