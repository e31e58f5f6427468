"""The counter history the controller keeps for the queueing policy, and the defaults a config
that names neither a weight policy nor an lb_policy gets."""

from __future__ import annotations

import asyncio

from envoy.config.cluster.v3 import cluster_pb2

from xds_server.config.load import parse_config
from xds_server.control.controller import Controller
from xds_server.telemetry.counters import ServiceHistory, reading_from_signals
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache


def test_readings_carry_work_counters_and_gauges() -> None:
    r = reading_from_signals(5.0, {"prompt_tokens": 100.0, "generation_tokens": 40.0,
                                   "requests_done": 3.0, "queue": 2.0, "running": 7.0,
                                   "kv_usage": 0.5})
    assert r is not None
    assert (r.at, r.tokens, r.prompt_tokens, r.requests_done, r.waiting, r.running,
            r.kv_usage) == (5.0, 140.0, 100.0, 3.0, 2.0, 7.0, 0.5)
    assert reading_from_signals(5.0, {"kv_usage": 0.5}) is None  # no counters: nothing


def test_history_is_bounded_ordered_and_forgets_unknown_endpoints() -> None:
    history = ServiceHistory(max_samples=4)
    for t in range(10):
        history.record("a", float(t), {"prompt_tokens": 10.0 * t})
    assert [r.at for r in history.readings("a")] == [6.0, 7.0, 8.0, 9.0]
    history.record("a", 9.0, {"prompt_tokens": 1.0})  # the same sample again: ignored
    assert history.readings("a")[-1].tokens == 90.0
    history.record("a", 3.0, {"prompt_tokens": 1.0})  # the clock stepped back: restart
    assert [r.at for r in history.readings("a")] == [3.0]
    history.record("b", 1.0, {"prompt_tokens": 1.0})
    history.forget({"b"})
    assert history.readings("a") == () and len(history.readings("b")) == 1


class CounterScraper:
    """Two vLLM-like servers: "fast" finishes 10x the work of "slow", which queues."""

    def __init__(self) -> None:
        self.t = 0

    async def scrape(self, targets, now, parse=None):
        self.t += 1
        out = {}
        for address in targets:
            fast = address.startswith("10.0.0.1")
            work = (10_000.0 if fast else 1_000.0) * 2 * self.t
            out[address] = ScrapeResult({
                "kv_usage": 0.3 if fast else 0.9, "queue": 0.0 if fast else 4.0,
                "running": 10.0, "kv_capacity_tokens": 100_000.0,
                "prompt_tokens": work * 0.7, "generation_tokens": work * 0.3,
                "requests_done": work / 2000.0}, None, now())
        return out

    async def close(self) -> None:
        pass


def test_a_config_naming_neither_gets_queueing_weights_and_least_request() -> None:
    config = parse_config({"telemetry": {"interval_seconds": 2, "stale_after_seconds": 6},
                           "pools": [{"name": "p", "model": "m", "endpoints": [
                               {"address": "10.0.0.1:80"}, {"address": "10.0.0.2:80"}]}]})
    assert config.weights.policy == "queueing" and config.pools[0].lb_policy == "least_request"
    clock = [1000.0]
    cache = SnapshotCache()
    controller = Controller(config, cache, scraper=CounterScraper(), clock=lambda: clock[0])
    for _ in range(6):
        asyncio.run(controller.tick())
        clock[0] += 2.0
    cluster = cache.snapshot.of_type(T.CLUSTER)["p"].message
    assert cluster.lb_policy == cluster_pb2.Cluster.LEAST_REQUEST
    weights = controller.weights["p"]
    fast, slow = weights.endpoints["10.0.0.1:80"], weights.endpoints["10.0.0.2:80"]
    # same KV capacity: one tier, one rate (at least what the busier one did: 10000 tokens/s),
    # published as one locality of equal host weights, so Envoy's least_request picks the
    # member with fewer requests in flight (the slow one keeps its requests longer)
    assert slow.breakdown["service_rate"] == fast.breakdown["service_rate"] == 10_000.0
    assert slow.breakdown["predicted_wait_s"] > fast.breakdown["predicted_wait_s"]
    assert fast.locality == slow.locality == "kv100000"
    cla = cache.snapshot.of_type(T.ENDPOINT)["p"].message
    assert [(loc.locality.zone, loc.load_balancing_weight.value,
             [lb.load_balancing_weight.value for lb in loc.lb_endpoints])
            for loc in cla.endpoints] == [("kv100000", 100, [100, 100])]
    assert cluster.least_request_lb_config.choice_count.value == 8


def test_a_standby_endpoint_is_priority_one_in_eds() -> None:
    from xds_server.envoy.build import eds_health as _eds_health
    from xds_server.envoy.build import eds_priority

    assert (_eds_health("STANDBY"), eds_priority("STANDBY")) == ("HEALTHY", 1)
    assert _eds_health("DEGRADED") == "DEGRADED" and _eds_health("STALE") == "HEALTHY"
