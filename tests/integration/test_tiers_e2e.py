"""Capacity tiers end to end: vLLM pages in, Envoy's locality-weighted split out.

Four fake vLLM servers behind ``trimtab serve`` (the default queueing policy) and a real
Envoy: two report a KV cache four times the other two's. trimtab publishes one locality per
capacity tier (``kv<tokens>``), weighted by the tier's share (here, without counters, its
capacity), every host of a tier at the same weight; Envoy, with
``locality_weighted_lb_config``, sends each tier its locality's share and splits it evenly
inside (requests one at a time: no active requests to tell the twins apart). The expected
numbers come from docs/configuration.md, not from trimtab's code.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import TrimtabProcess
from tests.support import BackendFleet, VllmPage
from tests.support.wait import wait_until
from trimtab_dev.envoy_process import EnvoyProcess, free_port, render_bootstrap

pytestmark = pytest.mark.slow

INTERVAL_S = 0.5
SETTLE_S = 15.0
MODEL = "m-tiers"
BLOCK = 16
BIG, SMALL = 25_000, 6_250  # GPU blocks: 400,000 and 100,000 KV tokens
REQUESTS = 800


def _config(path: Path, fleet: BackendFleet, ports: dict[str, int]) -> None:
    config = {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": INTERVAL_S, "stale_after_seconds": 3.0},
        "pools": [{"name": "tiers", "model": MODEL,
                   "endpoints": [{"address": address} for address in fleet.addresses]}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[BackendFleet, TrimtabProcess, EnvoyProcess, int]]:
    workdir = tmp_path_factory.mktemp("tiers")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    fleet = BackendFleet(4).start()
    trimtab = TrimtabProcess(workdir / "trimtab.yaml", ports["admin"], workdir / "trimtab.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "1"])
    try:
        for index, blocks in enumerate((BIG, BIG, SMALL, SMALL)):
            fleet.set_vllm(index, VllmPage(kv_usage=0.1, num_gpu_blocks=blocks,
                                           block_size=BLOCK))
        _config(workdir / "trimtab.yaml", fleet, ports)
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"]), workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        yield fleet, trimtab, envoy, ports["listener"]
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc) if p is not None]
        envoy.stop()
        trimtab.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


def _served(fleet: BackendFleet, port: int, requests: int) -> dict[str, int]:
    before = fleet.request_counts()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    try:
        for _ in range(requests):
            conn.request("POST", "/v1/chat/completions", body=body,
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
    finally:
        conn.close()
    after = fleet.request_counts()
    return {address: after[address] - before[address] for address in after}


def _slack(share: float) -> float:
    return 4 * math.sqrt(share * (1 - share) / REQUESTS) + 0.01


def test_capacity_tiers_are_weighted_localities_and_envoy_splits_by_them(stack) -> None:
    fleet, trimtab, envoy, port = stack
    big, small = f"kv{BIG * BLOCK}", f"kv{SMALL * BLOCK}"
    # without counters a tier weighs its capacity: 4 to 1, over 1 + waiting (none here)
    want = {big: 100, small: 25}
    doc = wait_until(trimtab.weights, SETTLE_S, f"trimtab's localities at {want}",
                     check=lambda d: d.get("localities", {}).get("tiers") == want)
    pool = doc["pools"]["tiers"]
    assert [pool[a]["locality"] for a in fleet.addresses] == [big, big, small, small]
    assert {pool[a]["weight"] for a in fleet.addresses} == {100}  # equal inside a tier
    wait_until(lambda: envoy.host_weights("tiers"), SETTLE_S, "Envoy holds the four hosts",
               check=lambda weights: len(weights) == 4)
    served = _served(fleet, port, REQUESTS)
    assert sum(served.values()) == REQUESTS, served
    share_big = sum(served[a] for a in fleet.addresses[:2]) / REQUESTS
    assert abs(share_big - 0.8) <= _slack(0.8), served  # the localities' 100 : 25
    for twins in (fleet.addresses[:2], fleet.addresses[2:]):  # even inside each tier
        tier = sum(served[a] for a in twins)
        assert abs(served[twins[0]] / tier - 0.5) <= 4 * math.sqrt(0.25 / tier) + 0.02, served
    # the status page's share (/v1/weights `share`, issue 25 item 3) is the split Envoy made
    page = {a: e["share"] for a, e in trimtab.weights()["pools"]["tiers"].items()}
    assert page == {a: pytest.approx(0.4) for a in fleet.addresses[:2]} | {
        a: pytest.approx(0.1) for a in fleet.addresses[2:]}, page
    for address in fleet.addresses:
        measured = served[address] / REQUESTS
        assert abs(page[address] - measured) <= _slack(page[address]), (page, served)


def _priorities(envoy: EnvoyProcess, cluster: str) -> dict[str, int]:
    """``{"ip:port": priority}`` for every host of ``cluster`` as Envoy holds it."""
    for status in envoy.clusters_json().get("cluster_statuses", []):
        if status.get("name") == cluster:
            return {f"{s['address']}:{s['port_value']}": int(h.get("priority", 0))
                    for h in status.get("host_statuses", [])
                    if (s := h.get("address", {}).get("socket_address", {}))}
    return {}


def test_a_tier_on_standby_is_priority_1_and_gets_nothing_until_it_is_back(stack) -> None:
    """Round 3's standby: a tier whose measured rate earns less than one weight unit goes to
    EDS priority 1, healthy, so Envoy sends it no new request while priority 0 is healthy
    (docs/configuration.md, "Standby"); once its rate is back it returns to priority 0."""
    fleet, trimtab, envoy, port = stack
    big, small = fleet.addresses[:2], fleet.addresses[2:]
    for index in range(4):  # every server queued, the small ones 1,000x slower
        fleet.set_vllm(index, kv_usage=0.5, waiting=4, running=8,
                       tokens_per_s=20_000.0 if index < 2 else 20.0)
    wait_until(lambda: trimtab.weights()["pools"]["tiers"], SETTLE_S * 2,
               "trimtab puts the small tier on standby",
               check=lambda pool: [pool[a]["health"] for a in small] == ["STANDBY"] * 2)
    want = {address: 1 for address in small} | {address: 0 for address in big}
    wait_until(lambda: _priorities(envoy, "tiers"), SETTLE_S, f"Envoy's priorities {want}",
               check=lambda p: p == want)
    served = _served(fleet, port, 200)
    assert sum(served[a] for a in small) == 0, served
    page = {a: e["share"] for a, e in trimtab.weights()["pools"]["tiers"].items()}
    assert [page[a] for a in small] == [0.0, 0.0] and sum(page.values()) == pytest.approx(1)
    assert sum(served[a] for a in big) == 200, served
    for index in (2, 3):  # as fast per KV token as the big tier: back in the split
        fleet.set_vllm(index, tokens_per_s=5_000.0)
    wait_until(lambda: _priorities(envoy, "tiers"), SETTLE_S * 2,
               "Envoy moves the small tier back to priority 0",
               check=lambda p: set(p.values()) == {0} and len(p) == 4)
    served = _served(fleet, port, 400)
    assert all(served[a] > 0 for a in small), served
