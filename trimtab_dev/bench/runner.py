"""The load of one benchmark: one open-loop schedule of ``warmup + duration`` seconds (the
same seed gives the same requests for every policy), sampled telemetry and a bounded tail.
The fleet, the stack per policy, the samplers and the child processes are in :mod:`.fleet`,
:mod:`.stack`, :mod:`.samplers` and :mod:`.processes`.

Requests scheduled in the warm-up are sent and answered but not measured. Sending stops at
the end of the schedule; a request still running ``tail_s`` seconds later is cancelled and
recorded as error ``unfinished`` (a policy that leaves requests queued for minutes fails
them rather than stretching the run without bound).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from trimtab_dev.bench.samplers import Sampler
from trimtab_dev.loadgen.runner import LagProbe, RequestRecord, make_session, send_one
from trimtab_dev.loadgen.workload import (
    Workload,
    build_schedule,
    endpoint_path,
    request_body,
    request_headers,
)

Clock = Callable[[], float]


# ---- the load -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadPlan:
    """One run's schedule: ``warmup + duration`` seconds at ``rate`` from ``seed``."""

    rate: float
    warmup: float
    duration: float
    seed: int
    tail_s: float

    @property
    def total(self) -> float:
        return self.warmup + self.duration


@dataclass
class LoadRun:
    """Every request of a run (warm-up included), on the run's clock (0 = first instant)."""

    records: list[RequestRecord]
    wall_s: float
    client: dict[str, float]
    unfinished: int
    started_unix: float
    samples: dict[str, list[tuple[float, Any]]] = field(default_factory=dict)


@dataclass
class Counters:
    sent: int = 0
    done: int = 0
    errors: int = 0
    refused: int = 0


async def _send_all(session: aiohttp.ClientSession, w: Workload, plan: LoadPlan, url: str,
                    clock: Clock, counters: Counters,
                    on_record: Callable[[RequestRecord], None] | None
                    ) -> dict[asyncio.Task[RequestRecord], RequestRecord]:
    target = url.rstrip("/") + endpoint_path(w)
    tasks: dict[asyncio.Task[RequestRecord], RequestRecord] = {}

    def finished(task: asyncio.Task[RequestRecord]) -> None:
        if task.cancelled():
            return
        counters.done += 1
        counters.errors += task.result().error is not None
        counters.refused += task.result().refused
        if on_record is not None:
            on_record(task.result())

    for p in build_schedule(w, rate=plan.rate, duration=plan.total, seed=plan.seed):
        delay = p.at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(p.index, p.cls, p.prompt_tokens, p.max_tokens, scheduled_at=p.at,
                            tenant=p.tenant)
        task = asyncio.create_task(send_one(session, target, request_body(p, w), w.stream,
                                            rec, clock, request_headers(p, w)))
        task.add_done_callback(finished)
        tasks[task] = rec
        counters.sent += 1
    return tasks


async def _finish(tasks: dict[asyncio.Task[RequestRecord], RequestRecord], clock: Clock,
                  deadline: float) -> int:
    """Wait for answers until ``deadline``; cancel the rest as ``unfinished``."""
    pending = [t for t in tasks if not t.done()]
    if pending and deadline > clock():
        _, still = await asyncio.wait(pending, timeout=deadline - clock())
        pending = list(still)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in pending:
        rec = tasks[task]
        rec.error, rec.e2e = "unfinished", clock() - rec.sent_at
    return len(pending)


async def drive(url: str, w: Workload, plan: LoadPlan, clock: Clock,
                counters: Counters | None = None,
                on_record: Callable[[RequestRecord], None] | None = None) -> LoadRun:
    """Send the plan's schedule open-loop through ``url``; see the module docstring."""
    counters = counters or Counters()
    probe = LagProbe()
    probe_task = asyncio.create_task(probe.run())
    started = time.time() - clock()
    try:
        async with make_session(w) as session:
            tasks = await _send_all(session, w, plan, url, clock, counters, on_record)
            unfinished = await _finish(tasks, clock, plan.total + plan.tail_s)
    finally:
        probe_task.cancel()
        await asyncio.gather(probe_task, return_exceptions=True)
    records = sorted(tasks.values(), key=lambda r: r.index)
    return LoadRun(records, clock(), probe.summary(), unfinished, started)


async def measure(url: str, w: Workload, plan: LoadPlan, samplers: list[Sampler],
                  counters: Counters | None = None,
                  on_record: Callable[[RequestRecord], None] | None = None) -> LoadRun:
    """:func:`drive` with the samplers running on the same clock."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    def clock() -> float:
        return loop.time() - t0

    async with aiohttp.ClientSession() as session:
        tasks = [asyncio.create_task(s.run(session, clock)) for s in samplers]
        try:
            run = await drive(url, w, plan, clock, counters, on_record)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    run.samples = {s.name: s.samples for s in samplers}
    return run
