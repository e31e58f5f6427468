"""The composite weight policy end to end: vLLM pages in, Envoy's split out.

Three fake vLLM servers behind ``trimtab serve`` (``weights.policy: composite``) and a real
Envoy. One reports a much fuller KV cache and a long queue: trimtab gives it a lower weight and
Envoy sends it clearly less traffic (counted at the backends); once it recovers, the split
evens out again. The expected weights come from the formula in docs/configuration.md, not from
trimtab's code.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
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
MODEL = "m-composite"
MIX = {"memory": 0.40, "queue": 0.35}  # the documented defaults; no ITL on these pages
QUEUE_CAP = 32
IDLE = VllmPage(kv_usage=0.10, waiting=0)
FULL = VllmPage(kv_usage=0.85, waiting=24)
REQUESTS = 600


def readme_weight(page: VllmPage, max_weight: int = 100) -> int:
    """docs/configuration.md: load = mix-weighted mean of KV use and waiting / queue_cap;
    weight = headroom x max_weight (equal capacities), in [1, max_weight]."""
    assert page.kv_usage is not None
    load = (MIX["memory"] * page.kv_usage
            + MIX["queue"] * min(page.waiting / QUEUE_CAP, 1.0)) / sum(MIX.values())
    return max(1, min(max_weight, round((1 - load) * max_weight)))


@dataclass
class CompositeStack:
    fleet: BackendFleet
    trimtab: TrimtabProcess
    envoy: EnvoyProcess
    port: int

    def trimtab_weights(self) -> dict[str, int]:
        pool = self.trimtab.weights()["pools"]["composite"]
        return {address: endpoint["weight"] for address, endpoint in pool.items()}

    def expect(self, pages: list[VllmPage]) -> dict[str, int]:
        """Set the pages, then wait for trimtab and Envoy to show the documented weights."""
        for index, page in enumerate(pages):
            self.fleet.set_vllm(index, page)
        want = {a: readme_weight(p) for a, p in zip(self.fleet.addresses, pages, strict=True)}
        wait_until(self.trimtab_weights, SETTLE_S, f"trimtab's /v1/weights at {want}",
                   check=lambda weights: weights == want)
        wait_until(lambda: self.envoy.host_weights("composite"), SETTLE_S,
                   f"Envoy's weights at {want}", check=lambda weights: weights == want)
        return want

    def shares(self, requests: int) -> dict[str, float]:
        """Send ``requests`` through Envoy; each backend's share of what the backends served."""
        before = self.fleet.request_counts()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
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
        after = self.fleet.request_counts()
        served = {address: after[address] - before[address] for address in after}
        assert sum(served.values()) == requests, served
        return {address: count / requests for address, count in served.items()}


def _config(path: Path, fleet: BackendFleet, ports: dict[str, int]) -> None:
    config = {
        "xds": {"address": f"127.0.0.1:{ports['xds']}"},
        "admin": {"address": f"127.0.0.1:{ports['admin']}"},
        "listener": {"address": f"127.0.0.1:{ports['listener']}"},
        "telemetry": {"interval_seconds": INTERVAL_S, "stale_after_seconds": 3.0},
        # alpha 1, no deadband: a weight follows its telemetry at the next tick
        "weights": {"policy": "composite", "composite": {
            "memory_mix": MIX["memory"], "queue_mix": MIX["queue"], "queue_cap": QUEUE_CAP,
            "ewma_alpha": 1.0, "deadband": 0}},
        "pools": [{"name": "composite", "model": MODEL,
                   "endpoints": [{"address": address} for address in fleet.addresses]}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.fixture(scope="module")
def composite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CompositeStack]:
    workdir = tmp_path_factory.mktemp("composite")
    ports = {name: free_port() for name in ("xds", "admin", "listener", "envoy_admin")}
    fleet = BackendFleet(3).start()
    trimtab = TrimtabProcess(workdir / "trimtab.yaml", ports["admin"], workdir / "trimtab.log")
    envoy = EnvoyProcess(extra_args=["--concurrency", "1"])
    try:
        for index in range(3):
            fleet.set_vllm(index, IDLE)
        _config(workdir / "trimtab.yaml", fleet, ports)
        trimtab.start()
        trimtab.wait_ready()
        envoy.start(render_bootstrap(xds_host="127.0.0.1", xds_port=ports["xds"],
                                     admin_port=ports["envoy_admin"], api="delta"),
                    workdir / "envoy.log")
        envoy.wait_ready(timeout=SETTLE_S)
        yield CompositeStack(fleet, trimtab, envoy, ports["listener"])
    finally:
        pids = [p.pid for p in (trimtab.proc, envoy.proc) if p is not None]
        envoy.stop()
        trimtab.stop()
        fleet.stop()
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left"


def _slack(share: float) -> float:
    return 4 * math.sqrt(share * (1 - share) / REQUESTS) + 0.01


def test_a_fuller_backend_gets_a_lower_weight_and_less_traffic(
        composite: CompositeStack) -> None:
    full, *idle = composite.fleet.addresses
    weights = composite.expect([FULL, IDLE, IDLE])
    assert weights[full] < min(weights[a] for a in idle) / 2, weights  # clearly lower
    shares = composite.shares(REQUESTS)
    total = sum(weights.values())
    for address, share in shares.items():  # Envoy splits by the weights trimtab computed
        assert abs(share - weights[address] / total) <= _slack(weights[address] / total), \
            (shares, weights)
    assert all(shares[full] < shares[a] / 2 for a in idle), shares

    weights = composite.expect([IDLE, IDLE, IDLE])  # it drains its queue: back to even
    assert len(set(weights.values())) == 1, weights
    shares = composite.shares(REQUESTS)
    assert all(abs(share - 1 / 3) <= _slack(1 / 3) for share in shares.values()), shares
