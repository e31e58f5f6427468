"""The autoscaler wired into the tick loop: vLLM pages -> SLO histograms and KV use -> score,
decision, Prometheus gauges and the value the KEDA scaler serves.

The pure decision rules are tested in test_scaling.py; here a controller ticks on a fake clock
over the fake model servers of tests/support (their real vLLM + DCGM metrics pages, parsed by
the real page parsers), and every answer is read where operators and KEDA read it.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import cast

import pytest
from prometheus_client import REGISTRY

from tests.support import Backend, VllmPage
from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.keda import ExternalScalerServicer, metric_name
from xds_server.keda import externalscaler_pb2 as pb2
from xds_server.telemetry.scrape import Scraper, ScrapeResult
from xds_server.xds.cache import SnapshotCache

HOT, IDLE, DARK = "as-hot", "as-idle", "as-dark"  # unique pool names: the gauges are global
ADDRESSES = {HOT: ["10.9.0.1:8000", "10.9.0.2:8000"], IDLE: ["10.9.1.1:8000"],
             DARK: ["10.9.2.1:8000"]}
SLOW_TTFT_S, FAST_TTFT_S = 2.0, 0.004  # in vLLM's buckets (1.0, 2.5] and (0.001, 0.005]
SLOW_P95_S = 1.0 + (2.5 - 1.0) * 0.95  # histogram_quantile inside the only filled bucket
FAST_P95_S = 0.001 + (0.005 - 0.001) * 0.95


def _config(pools: tuple[str, ...] = (HOT, IDLE, DARK)) -> Config:
    scaling = {
        HOT: {"latency_slo_seconds": 1.0, "min_replicas": 1, "max_replicas": 4,
              "scale_up_cooldown_seconds": 60, "scale_down_cooldown_seconds": 120},
        IDLE: None,  # no policy of its own: the defaults (min 1, max 10)
        DARK: {"min_replicas": 2, "max_replicas": 3},
    }
    return parse_config({
        "telemetry": {"interval_seconds": 1, "stale_after_seconds": 30},
        "weights": {"policy": "composite"},
        "pools": [{"name": name, "model": f"model-{name}", "scaling": scaling[name],
                   "endpoints": [{"address": a} for a in ADDRESSES[name]]}
                  for name in pools],
    })


class FakeServers:
    """A scraper answering with each fake server's whole /metrics page (DCGM + vLLM)."""

    def __init__(self) -> None:
        self.servers = {address: Backend(vllm=VllmPage(kv_usage=0.0, ttft_s=FAST_TTFT_S))
                        for addresses in ADDRESSES.values() for address in addresses}
        self.unreachable = set(ADDRESSES[DARK])
        self.parser = Scraper(timeout_seconds=1.0)  # only its page path: bounds, decode, parse

    async def scrape(self, targets, now, parse=None):
        out = {}
        for address in targets:
            if address in self.unreachable:
                out[address] = ScrapeResult(None, "connect: refused", now())
                continue
            body = self.servers[address].page_text().encode()
            out[address] = self.parser.parse_body(body, parse, now())  # the real Scraper's path
        return out

    async def close(self) -> None:
        pass

    def load(self, pool: str, kv_usage: float, requests: int = 0,
             ttft_s: float = FAST_TTFT_S) -> None:
        """Set the pool's KV use and serve ``requests`` per server at ``ttft_s``."""
        for address in ADDRESSES[pool]:
            server = self.servers[address]
            page = server.vllm = replace(server.vllm or VllmPage(), kv_usage=kv_usage,
                                         ttft_s=ttft_s)
            for _ in range(requests):
                server.vllm_counters.observe(page, 200)


class _NoAbort:
    async def abort(self, code, details):
        raise AssertionError(f"scaler aborted: {code} {details}")


class Rig:
    def __init__(self) -> None:
        self.now = 1000.0
        self.servers = FakeServers()
        self.controller = Controller(_config(), SnapshotCache(),
                                     scraper=cast(Scraper, self.servers),
                                     clock=lambda: self.now)
        self.keda = ExternalScalerServicer(self.controller.autoscaler.source)

    async def tick_at(self, now: float) -> None:
        self.now = now
        await self.controller.tick()

    async def keda_value(self, pool: str) -> int:
        ref = pb2.ScaledObjectRef(name="vllm", namespace="models", scalerMetadata={"pool": pool})
        answer = await self.keda.GetMetrics(pb2.GetMetricsRequest(scaledObjectRef=ref),
                                            _NoAbort())
        (value,) = answer.metricValues
        assert value.metricName == metric_name(pool) and value.metricValueFloat == value.metricValue
        return value.metricValue

    async def answers(self, pool: str) -> tuple[int, int, float | None, float | None]:
        """(desired replicas gauge, KEDA metric value, score gauge, score served)."""
        labels = {"pool": pool}
        desired = REGISTRY.get_sample_value("trimtab_pool_desired_replicas", labels)
        score = REGISTRY.get_sample_value("trimtab_pool_scale_score", labels)
        assert desired is not None
        source = self.controller.autoscaler.source
        assert source.desired_replicas(pool) == desired
        return int(desired), await self.keda_value(pool), score, source.score(pool)


def _hot_score(p95_s: float, kv_usage: float) -> float:
    return 0.6 * (p95_s / 1.0) + 0.4 * kv_usage


async def _scenario() -> None:
    rig = Rig()
    servers = rig.servers

    # First tick: one histogram point, so no latency yet; memory alone (0.5) holds at min.
    servers.load(HOT, 0.5)
    servers.load(IDLE, 0.5)
    await rig.tick_at(1000.0)
    desired, served, score, source_score = await rig.answers(HOT)
    assert (desired, served) == (1, 1)
    assert score == pytest.approx(0.5) and source_score == pytest.approx(0.5)

    # Slow first tokens (2 s against a 1 s SLO): score above 0.8 -> one more replica.
    servers.load(HOT, 0.5, requests=20, ttft_s=SLOW_TTFT_S)
    servers.load(IDLE, 0.5, requests=20)
    await rig.tick_at(1010.0)
    desired, served, score, _ = await rig.answers(HOT)
    assert (desired, served) == (2, 2)
    assert score == pytest.approx(_hot_score(SLOW_P95_S, 0.5))
    # The idle pool is judged on its own servers' latency only (fast), not the hot pool's.
    desired, served, score, _ = await rig.answers(IDLE)
    assert (desired, served) == (1, 1)
    assert score == pytest.approx(0.6 * FAST_P95_S + 0.4 * 0.5)

    # Still hot, but inside the 60 s scale-up cooldown: held, up to its last instant.
    for now in (1040.0, 1069.0):
        servers.load(HOT, 0.5, requests=20, ttft_s=SLOW_TTFT_S)
        await rig.tick_at(now)
        assert (await rig.answers(HOT))[:2] == (2, 2), now
    servers.load(HOT, 0.5, requests=20, ttft_s=SLOW_TTFT_S)
    await rig.tick_at(1070.0)
    assert (await rig.answers(HOT))[:2] == (3, 3)

    # Cold: fast and nearly empty. Once the 60 s latency window holds only fast requests the
    # score drops below 0.3, but a scale-down after a scale-up waits 120 s (until 1190).
    for now in (1080.0, 1100.0):
        servers.load(HOT, 0.1, requests=20)
        await rig.tick_at(now)
        assert (await rig.answers(HOT))[:2] == (3, 3), now
    for now in (1141.0, 1189.0):
        servers.load(HOT, 0.1, requests=20)
        await rig.tick_at(now)
        desired, served, score, _ = await rig.answers(HOT)
        assert (desired, served) == (3, 3), now
        assert score == pytest.approx(_hot_score(FAST_P95_S, 0.1)), now
    expected = {1190.0: 2, 1250.0: 2, 1309.0: 2, 1310.0: 1, 1430.0: 1}  # down cooldown, then min
    for now, want in expected.items():
        servers.load(HOT, 0.1, requests=20)
        await rig.tick_at(now)
        assert (await rig.answers(HOT))[:2] == (want, want), now

    # A pool without telemetry holds at its policy's min (2) and exports no score.
    desired, served, score, source_score = await rig.answers(DARK)
    assert (desired, served, score, source_score) == (2, 2, None, None)

    # A pool removed from the config disappears from KEDA's source and from /metrics.
    rig.controller.apply_config(_config((HOT, DARK)))
    assert IDLE not in rig.controller.autoscaler.source.pool_names()
    assert REGISTRY.get_sample_value("trimtab_pool_desired_replicas", {"pool": IDLE}) is None
    assert REGISTRY.get_sample_value("trimtab_pool_scale_score", {"pool": IDLE}) is None
    await rig.tick_at(1431.0)
    assert (await rig.answers(HOT))[:2] == (1, 1)


def test_autoscaler_through_the_tick_loop_to_metrics_and_keda():
    asyncio.run(_scenario())


async def _score_goes_away() -> None:
    rig = Rig()
    rig.servers.load(HOT, 0.5)
    await rig.tick_at(1000.0)
    assert (await rig.answers(HOT))[2] == pytest.approx(0.5)
    rig.servers.unreachable |= set(ADDRESSES[HOT])
    await rig.tick_at(1040.0)  # beyond stale_after: no fresh memory, no latency
    desired, served, score, source_score = await rig.answers(HOT)
    assert (desired, served) == (1, 1) and score is None and source_score is None


def test_lost_telemetry_removes_the_score_and_holds_the_replicas():
    asyncio.run(_score_goes_away())
