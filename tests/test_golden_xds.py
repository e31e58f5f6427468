"""Golden xDS bytes: for fixed configs and fixed telemetry pages, every CDS/EDS/LDS/RDS
resource and version trimtab publishes, tick by tick, is exactly what it was.

It was recorded before the architecture move (issue 14) and pins behaviour across refactors:
a change that alters what Envoy receives fails here. When a change is *meant* to alter the
bytes, re-record with ``TRIMTAB_GOLDEN_UPDATE=1 pytest tests/test_golden_xds.py`` and say why
in the commit. The telemetry enters through the real scraper's parse path (only the HTTP
fetch is replaced) with a fake clock, so the recording does not depend on timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from xds_server.config.load import parse_config
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.telemetry.scrape import Scraper
from xds_server.xds import type_urls as T
from xds_server.xds.cache import SnapshotCache

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "fixtures" / "golden_xds.json"
TICKS = 4
INTERVAL = 2.0
START = 1_700_000_000.0


def vllm_page(model: str, running: float, waiting: float, kv: float, blocks: int,
              prompt_total: float, gen_total: float, finished: float, ttft: tuple[float, ...],
              itl_sum: float, itl_count: float) -> str:
    """A vLLM v1 page with the series trimtab reads (the buckets are TTFT counts)."""
    label = f'engine="0",model_name="{model}"'
    lines = [
        f"vllm:num_requests_running{{{label}}} {running}",
        f"vllm:num_requests_waiting{{{label}}} {waiting}",
        f"vllm:kv_cache_usage_perc{{{label}}} {kv}",
        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0',
        f"vllm:prompt_tokens_total{{{label}}} {prompt_total}",
        f"vllm:generation_tokens_total{{{label}}} {gen_total}",
        f'vllm:request_success_total{{{label},finished_reason="stop"}} {finished}',
    ]
    edges = ("0.1", "0.5", "1.0", "5.0", "+Inf")
    cumulative = 0.0
    for edge, count in zip(edges, ttft, strict=True):
        cumulative += count
        lines.append(f'vllm:time_to_first_token_seconds_bucket{{{label},le="{edge}"}} {cumulative}')
    lines.append(f"vllm:time_to_first_token_seconds_count{{{label}}} {cumulative}")
    lines.append(f"vllm:time_to_first_token_seconds_sum{{{label}}} {cumulative * 0.3}")
    lines.append(f"vllm:inter_token_latency_seconds_sum{{{label}}} {itl_sum}")
    lines.append(f"vllm:inter_token_latency_seconds_count{{{label}}} {itl_count}")
    types = ("# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_waiting gauge\n"
             "# TYPE vllm:kv_cache_usage_perc gauge\n# TYPE vllm:cache_config_info gauge\n"
             "# TYPE vllm:prompt_tokens_total counter\n"
             "# TYPE vllm:generation_tokens_total counter\n"
             "# TYPE vllm:request_success_total counter\n"
             "# TYPE vllm:time_to_first_token_seconds histogram\n"
             "# TYPE vllm:inter_token_latency_seconds histogram\n")
    return types + "\n".join(lines) + "\n"


def dcgm_page(used: float, free: float) -> str:
    return ("# TYPE DCGM_FI_DEV_FB_USED gauge\n# TYPE DCGM_FI_DEV_FB_FREE gauge\n"
            f'DCGM_FI_DEV_FB_USED{{gpu="0",UUID="GPU-0"}} {used}\n'
            f'DCGM_FI_DEV_FB_FREE{{gpu="0",UUID="GPU-0"}} {free}\n')


def fleet_pages(config: Config, tick: int) -> dict[str, str]:
    """Every endpoint's page at ``tick``: a deterministic load that differs by endpoint
    (its index in the config) and moves from tick to tick, counters only growing."""
    pages: dict[str, str] = {}
    index = 0
    for pool in config.pools:
        endpoints = list(pool.endpoints)
        for version in (pool.versions or {}).values():
            endpoints.extend(version.endpoints)
        for ep in endpoints:
            index += 1
            size = (4096, 16384, 65536)[index % 3]          # an L4, an A100, an H100 KV
            speed = (300.0, 1500.0, 4000.0)[index % 3]       # tokens per second
            t = tick + 1
            running = float((index * 3 + tick * 2) % 9)
            waiting = float((index + tick * 3) % 5) if index % 4 else 0.0
            kv = round(((index * 7 + tick * 11) % 90) / 100.0, 2)
            if config.weights.policy == "gpu_memory":
                used = 10000.0 + 3000.0 * ((index + tick) % 7)
                pages[ep.scrape_url] = dcgm_page(used, 80000.0 - used)
                continue
            pages[ep.scrape_url] = vllm_page(
                pool.model, running, waiting, kv, size,
                prompt_total=1e6 + speed * 0.8 * INTERVAL * t * (1 + index % 2),
                gen_total=5e5 + speed * 0.2 * INTERVAL * t,
                finished=1000.0 + t * (index % 5 + 1),
                ttft=(10.0 * t, 5.0 * t, float(index % 3) * t, float(tick), 0.0),
                itl_sum=100.0 + 0.02 * t * speed, itl_count=5000.0 + t * speed)
    return pages


class PageScraper(Scraper):
    """The real scraper (bounds, parse, problems) with the HTTP fetch replaced by pages."""

    def __init__(self, pages: Callable[[], dict[str, str]]) -> None:
        super().__init__(timeout_seconds=1.0)
        self.pages = pages

    async def _fetch(self, session: Any, url: str) -> bytes:  # type: ignore[override]
        page = self.pages().get(url)
        if page is None:
            raise ConnectionError(f"no page for {urlsplit(url).netloc}")
        return page.encode()


def inline(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


SCENARIOS: dict[str, dict[str, Any]] = {
    "seed-gpu-memory": {
        "weights": {"policy": "gpu_memory"},
        "pools": [{"name": "llama", "model": "m", "lb_policy": "round_robin",
                   "endpoints": [{"address": f"10.0.0.{i}:8000"} for i in range(1, 4)]}],
    },
    "composite-fallback": {
        "weights": {"policy": "composite"},
        "pools": [
            {"name": "big", "model": "m1", "fallback": "spill",
             "long_context": {"pool": "long", "min_prompt_bytes": 32768},
             "endpoints": [{"address": f"10.0.1.{i}:8000"} for i in range(1, 5)]},
            {"name": "long", "model": "m1",
             "endpoints": [{"address": "10.0.2.1:8000"}]},
            {"name": "spill", "model": "m2",
             "endpoints": [{"address": "10.0.3.1:8000"}, {"address": "10.0.3.2:8000"}]},
        ],
    },
    "queueing-auto-classes": {
        "pools": [
            {"name": "hetero", "model": "m", "long_context": "auto",
             "endpoints": [{"address": f"10.1.0.{i}:8000"} for i in range(1, 7)]},
            {"name": "rr", "model": "n", "lb_policy": "round_robin",
             "endpoints": [{"address": f"10.1.1.{i}:8000"} for i in range(1, 4)]},
        ],
    },
    "canary": {
        "pools": [{"name": "p", "model": "m",
                   "versions": {"stable": {"endpoints": [{"address": "10.2.0.1:8000"},
                                                         {"address": "10.2.0.2:8000"}]},
                                "canary": {"endpoints": [{"address": "10.2.1.1:8000"}]}},
                   "rollout": {"start_percent": 10, "step_percent": 10,
                               "step_interval_seconds": 2}}],
    },
    "tiers-example": inline("trimtab-tiers.yaml"),
    "local-example": inline("local.yaml"),
}


def resource_digest(controller: Controller) -> dict[str, Any]:
    snapshot = controller.cache.snapshot
    out: dict[str, Any] = {}
    for type_url in (T.CLUSTER, T.ENDPOINT, T.LISTENER, T.ROUTE):
        resources = snapshot.of_type(type_url)
        out[type_url.rsplit(".", 1)[-1]] = {
            name: {"version": res.version, "sha256": hashlib.sha256(res.payload).hexdigest()}
            for name, res in sorted(resources.items())}
    out["type_versions"] = dict(sorted(snapshot.versions.items()))
    out["snapshot_version"] = snapshot.version
    return out


def run_scenario(raw: dict[str, Any]) -> list[dict[str, Any]]:
    config = parse_config(raw)
    clock = [START]
    pages: list[dict[str, str]] = [{}]
    scraper = PageScraper(lambda: pages[0])
    controller = Controller(config, SnapshotCache(), scraper=scraper, clock=lambda: clock[0])

    async def ticks() -> list[dict[str, Any]]:
        recorded = []
        try:
            for t in range(TICKS):
                pages[0] = fleet_pages(config, t)  # once per tick, not once per fetch
                await controller.tick()
                recorded.append(resource_digest(controller))
                clock[0] += INTERVAL
        finally:
            await scraper.close()
        return recorded

    return asyncio.run(ticks())


def record_all() -> dict[str, Any]:
    return {name: run_scenario(raw) for name, raw in SCENARIOS.items()}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if os.environ.get("TRIMTAB_GOLDEN_UPDATE") == "1":
        GOLDEN.write_text(json.dumps(record_all(), indent=1, sort_keys=True) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_resource_and_version_is_byte_for_byte_what_was_recorded(golden, name):
    assert run_scenario(SCENARIOS[name]) == golden[name]


def test_the_recording_covers_every_type_and_weights_that_move(golden):
    """The golden file is not vacuous: each type is present and EDS changes across ticks."""
    for name, ticks in golden.items():
        assert len(ticks) == TICKS, name
        for kind in ("Cluster", "ClusterLoadAssignment", "Listener", "RouteConfiguration"):
            assert ticks[-1][kind], (name, kind)
    moved = [name for name, ticks in golden.items()
             if ticks[0]["ClusterLoadAssignment"] != ticks[-1]["ClusterLoadAssignment"]]
    assert len(moved) >= 4, moved


def test_the_recording_is_deterministic():
    """Two runs in one process agree: nothing in the digest depends on time or order."""
    raw = SCENARIOS["queueing-auto-classes"]
    assert run_scenario(raw) == run_scenario(raw)
