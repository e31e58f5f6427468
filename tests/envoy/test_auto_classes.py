"""``long_context: auto``: classes from KV capacities, and the resources the controller builds."""

from __future__ import annotations

import asyncio

import pytest

from xds_server.config.load import ConfigError, parse_config
from xds_server.control.controller import Controller
from xds_server.envoy.prompt_classes import AutoClass, derive_classes, tiers
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

H100, A100, L4 = 453_776.0, 167_184.0, 38_128.0  # the simulator's KV tokens (cache_config_info)
HETERO = {"10.0.0.1:80": H100, "10.0.0.2:80": H100, "10.0.0.3:80": A100,
          "10.0.0.4:80": A100, "10.0.0.5:80": L4, "10.0.0.6:80": L4}


def test_a_mixed_pool_gets_one_class_per_bigger_tier() -> None:
    classes = derive_classes("p", HETERO)
    l4_bound = int(L4 / 8) * 4  # 1/8 of the L4's KV, 4 bytes per token
    a100_bound = int(A100 / 8) * 4
    assert classes == (
        AutoClass("trimtab-auto-p-1", l4_bound, a100_bound,
                  ("10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80")),
        AutoClass("trimtab-auto-p-2", a100_bound, None, ("10.0.0.1:80", "10.0.0.2:80")),
    )
    assert l4_bound == 19_064 and a100_bound == 83_592  # ~4.8k and ~21k prompt tokens


def test_no_classes_for_a_homogeneous_pool_or_unknown_capacities() -> None:
    assert derive_classes("p", {"a": A100, "b": A100, "c": A100}) == ()
    assert derive_classes("p", {"a": A100, "b": A100 * 1.9}) == ()  # within a factor 2: one tier
    assert derive_classes("p", {"a": H100, "b": L4, "c": None}) == ()  # not split on a guess
    assert derive_classes("p", {"a": H100, "b": float("nan")}) == ()
    assert derive_classes("p", {}) == ()
    assert tiers({"a": 10.0, "b": 19.0, "c": 20.0, "d": 45.0}) == [["a", "b"], ["c"], ["d"]]


def _config(capacities: dict[str, float], auto: bool = True):
    pool = {"name": "p", "model": "m",
            "endpoints": [{"address": a} for a in capacities]}
    if auto:
        pool["long_context"] = "auto"
    return parse_config({"telemetry": {"interval_seconds": 1, "stale_after_seconds": 3},
                         "weights": {"policy": "composite"}, "pools": [pool]})


class CapacityScraper:
    """vLLM-like signals with each endpoint's KV capacity."""

    def __init__(self, capacities: dict[str, float]) -> None:
        self.capacities = capacities

    async def scrape(self, targets, now, parse=None):
        return {a: ScrapeResult({"kv_usage": 0.2, "queue": 0.0,
                                 "kv_capacity_tokens": self.capacities[a]}, None, now())
                for a in targets}

    async def close(self) -> None:
        pass


def _run(capacities: dict[str, float], auto: bool = True) -> tuple[Controller, SnapshotCache]:
    cache = SnapshotCache()
    controller = Controller(_config(capacities, auto), cache,
                            scraper=CapacityScraper(capacities), clock=lambda: 1000.0)
    asyncio.run(controller.tick())
    return controller, cache


def _members(cache: SnapshotCache, cluster: str) -> dict[str, int]:
    cla = cache.snapshot.of_type(T.ENDPOINT)[cluster].message
    return {f"{e.endpoint.address.socket_address.address}:"
            f"{e.endpoint.address.socket_address.port_value}": e.load_balancing_weight.value
            for e in cla.endpoints[0].lb_endpoints}


def test_the_controller_publishes_derived_clusters_and_content_length_routes() -> None:
    controller, cache = _run(HETERO)
    clusters = set(cache.snapshot.of_type(T.CLUSTER))
    assert {"p", "trimtab-auto-p-1", "trimtab-auto-p-2"} <= clusters
    pool_weights = _members(cache, "p")
    big = _members(cache, "trimtab-auto-p-2")
    assert set(big) == {"10.0.0.1:80", "10.0.0.2:80"}
    assert big == {a: pool_weights[a] for a in big}  # the pool's own weights
    assert set(_members(cache, "trimtab-auto-p-1")) == set(HETERO) - {"10.0.0.5:80",
                                                                       "10.0.0.6:80"}
    route = cache.snapshot.of_type(T.ROUTE)["trimtab-routes"].message
    ranges = {}
    for r in route.virtual_hosts[0].routes:
        for h in r.match.headers:
            if h.name == "content-length" and r.name.startswith("body:"):
                ranges[r.route.cluster] = (h.range_match.start, h.range_match.end)
    assert ranges == {"trimtab-auto-p-1": (19_064, 83_592),
                      "trimtab-auto-p-2": (83_592, 2**63 - 1)}


def test_a_homogeneous_pool_gets_no_derived_resources() -> None:
    _, cache = _run({"10.0.0.1:80": A100, "10.0.0.2:80": A100})
    assert set(cache.snapshot.of_type(T.CLUSTER)) == {"p"}
    route = cache.snapshot.of_type(T.ROUTE)["trimtab-routes"].message
    assert not any(h.name == "content-length" for r in route.virtual_hosts[0].routes
                   for h in r.match.headers)
    _, cache = _run(HETERO, auto=False)  # mixed, but not asked for
    assert set(cache.snapshot.of_type(T.CLUSTER)) == {"p"}


def test_auto_with_canary_versions_is_refused() -> None:
    with pytest.raises(ConfigError, match="long_context"):
        parse_config({"pools": [{"name": "p", "model": "m", "long_context": "auto",
                                 "versions": {"stable": {"endpoints": [{"address": "10.0.0.1:80"}]},
                                              "canary": {"endpoints": [{"address": "10.0.0.2:80"}]}}}]})


def test_a_measured_rate_caps_a_tiers_bound_by_its_prefill_time() -> None:
    """A prompt that holds a small GPU longer than one tick goes to the bigger ones: with
    L4s at 1 200 and A100s at 7 000 tokens/s and a 2 s tick, the bounds fall from 1/8 of the
    KV (4.8k and 21k tokens) to 2 048 and 8 192 tokens (powers of two below 2.4k and 14k)."""
    rates = {a: {H100: 20_000.0, A100: 7_000.0, L4: 1_200.0}[c] for a, c in HETERO.items()}
    classes = derive_classes("p", HETERO, rates, 2.0)
    assert [(c.min_prompt_bytes, c.max_prompt_bytes) for c in classes] == [
        (2048 * 4, 8192 * 4), (8192 * 4, None)]
    assert derive_classes("p", HETERO, rates, 0.0) == derive_classes("p", HETERO)  # no tick
    fast = {a: 1e9 for a in HETERO}  # prefill no constraint: the KV rule alone
    assert derive_classes("p", HETERO, fast, 2.0) == derive_classes("p", HETERO)
    # a rate that wanders by 10 % keeps the bounds (hysteresis), a halving moves them
    wobble = {a: r * 1.1 for a, r in rates.items()}
    assert derive_classes("p", HETERO, wobble, 2.0, classes) == classes
    slower = {a: r / 2.2 for a, r in rates.items()}
    moved = derive_classes("p", HETERO, slower, 2.0, classes)
    assert [c.min_prompt_bytes for c in moved] == [1024 * 4, 4096 * 4]


def test_bounds_never_decrease_from_one_tier_to_the_next() -> None:
    rates = {a: {H100: 20_000.0, A100: 300.0, L4: 1_200.0}[c] for a, c in HETERO.items()}
    classes = derive_classes("p", HETERO, rates, 2.0)
    # the A100s measured slower than the L4s: their class would be empty and is left out;
    # every prompt the L4s do not take goes to the H100s
    assert [(c.cluster, c.min_prompt_bytes, c.max_prompt_bytes) for c in classes] == [
        ("trimtab-auto-p-2", 2048 * 4, None)]
