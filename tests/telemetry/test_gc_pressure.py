"""Ticks and the cyclic garbage collector (issue 13 §1): a full collection holds the GIL on
whichever thread runs it and costs in proportion to the tracked objects it walks, so the
per-endpoint state a tick keeps must not be tracked, and a tick must leave no cyclic garbage
(the collector would have to find it). Counts, not timings."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections import Counter

from xds_server.admin.history import history_point
from xds_server.app import Trimtab
from xds_server.config.load import parse_config
from xds_server.telemetry.scrape import ScrapeResult

ENDPOINTS = 300


def fleet_config():
    endpoints = [{"address": f"10.9.{i // 256}.{i % 256}:8000"} for i in range(ENDPOINTS)]
    return parse_config({
        "telemetry": {"interval_seconds": 2},
        "weights": {"policy": "composite"},
        "pools": [{"name": "fleet", "model": "m", "endpoints": endpoints}],
    })


class JitterSource:
    """Every endpoint read each tick with fresh values; every 7th one fails, every 11th one
    sends a rejected value (so the held-value and error paths run too)."""

    def __init__(self) -> None:
        self.rng = random.Random(13)
        self.ticks = 0

    async def collect(self, endpoints, clock):
        self.ticks += 1
        out = {}
        for i, ep in enumerate(endpoints):
            if (i + self.ticks) % 7 == 0:
                out[ep.address] = ScrapeResult(None, "connect: refused", clock())
                continue
            signals = {"kv_usage": self.rng.random(), "queue": float(self.rng.randrange(40)),
                       "running": 3.0, "itl_ms": self.rng.uniform(5, 120),
                       "gpu_mem_pct": self.rng.uniform(80, 95)}
            if (i + self.ticks) % 11 == 0:
                signals["kv_usage"] = float("nan")
            out[ep.address] = ScrapeResult(signals, None, clock())
        return out

    async def close(self) -> None:
        pass


def test_ticks_leave_no_cyclic_garbage_and_no_growing_tracked_heap(caplog):
    caplog.set_level(logging.ERROR, logger="trimtab")  # captured records would be kept
    app = Trimtab(fleet_config())
    controller = app.controller
    controller.sources["scrape"] = JitterSource()
    clock = [1000.0]
    controller.clock = lambda: clock[0]
    app.history.resize(5)  # full after the warm-up (a point is a few objects, not per endpoint)

    async def tick() -> None:
        clock[0] += 2.0
        await controller.tick()

    async def scenario() -> tuple[list[int], int, int, int, Counter[str]]:
        for _ in range(6):  # warm-up: the first tick freezes the startup heap
            await tick()
        assert gc.get_freeze_count() > 0
        found: list[int] = []
        counts: dict[int, list[int]] = {19: [], 59: []}
        for i in range(63):
            await tick()
            found.append(gc.collect())  # what the ticks left for the collector to find
            for start, seen in counts.items():  # after a settling stretch (caches, history)
                if start <= i < start + 3:
                    seen.append(len(gc.get_objects()))
        # the least of three ticks: the worker thread may still hold its last work item (the
        # executor drops it only after the loop has resumed), a transient, not growth
        before, after = min(counts[19]), min(counts[59])
        gc.collect()  # a tuple is untracked by the pass after the one that untracks its items
        rows = list(controller.store._rows.values())
        tracked_rows = sum(gc.is_tracked(row) for row in rows)
        kinds = Counter(type(o).__name__ for o in gc.get_objects())  # not frozen: since tick 1
        await controller.close()
        return found, before, after, tracked_rows, kinds

    found, before, after, tracked_rows, kinds = asyncio.run(scenario())
    assert found == [0] * 63
    assert after - before <= 5, (before, after)  # flat over 40 ticks of 300 endpoints
    # Long-lived per-endpoint state: the store's rows are untracked; per endpoint only its
    # EndpointWeight stays tracked (and metric series first set after tick 1), no
    # observation, sample, read, or container of them.
    assert tracked_rows == 0
    assert kinds["EndpointWeight"] == ENDPOINTS
    assert kinds["Observation"] == kinds["Sample"] == kinds["ScrapeResult"] == 0, kinds
    # the containers left: the 5 history points, the snapshot, asyncio: a few dozen in all
    assert kinds["tuple"] + kinds["dict"] + kinds["list"] < 50, kinds
    assert len(app.history) == 5


def test_a_history_points_weight_maps_are_untracked():
    doc = {"pools": {"p": {f"a{i}": {"weight": i % 100 + 1, "stale": i % 3 == 0}
                           for i in range(50)}}}
    point = history_point(5.0, doc)
    gc.collect()
    assert not any(gc.is_tracked(m) for m in point.weights.values())  # per endpoint: none
    assert point.weights["p"]["a3"] == 4 and "a3" in point.stale["p"]
