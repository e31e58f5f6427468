"""A continuous-batching LLM engine in the image of vLLM's V1 scheduler. Pure logic, no I/O.

Time comes from an injected clock (or an explicit ``now``), so tests and capacity estimates
run in virtual time with :class:`ManualClock` and :func:`run_virtual`; the HTTP server drives
the same engine in real time.

Scheduling, one step at a time (vllm/v1/core/sched/scheduler.py):

* A step has a token budget (``max_num_batched_tokens``). Running requests are scheduled
  first, in admission order: one token each when decoding, or the next chunk of a prompt
  (chunked prefill). Waiting requests are then admitted first-come-first-served while the
  budget, ``max_num_seqs`` and free KV blocks allow; the head of the queue blocks the rest.
* KV is allocated in 16-token blocks for the tokens computed so far. A running request that
  cannot get a block preempts the newest running request (recompute: its blocks are freed
  and it goes back to the head of the queue); no request ever fails for lack of KV. A step
  that preempted admits nobody new.
* Prefix caching (on by default in V1) is modelled for preempted requests only: their freed
  blocks count as free but keep their contents until another allocation evicts them (oldest
  preemption first), and a re-admitted request skips recomputing the blocks that survived.
  Our synthetic prompts share no prefixes, so there are no other cache hits.
* When a request's last pending token has been computed, the step samples one output token.

Step time is a roofline: ``overhead + max(bytes / (bandwidth x MBU), flops / (peak x MFU))``
where bytes = weights + the KV read by every scheduled request and flops = 2 x params x
tokens + attention. Decode is bandwidth-bound (weights + a KV read that grows with the batch
and its context lengths), prefill is compute-bound. ``slow`` multiplies the result.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from trimtab_dev.sim.profiles import Efficiency, GpuProfile, ModelProfile, kv_capacity_tokens

# Bucket boundaries of vLLM's own histograms (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BUSY_WINDOW_S = 1.0  # DCGM_FI_DEV_GPU_UTIL is a busy fraction over roughly its sample period
RATE_WINDOW_S = 10.0


class Histogram:
    """Cumulative-style histogram: per-bucket counts (last = +Inf), sum and count."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, Prometheus style, ending with ``+Inf``."""
        out, running = [], 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class EngineStats:
    """Counters and histograms with vLLM's meanings; the server renders them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: int = 0
    preemptions: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass(eq=False)
class SimRequest:
    """One generation request as the engine sees it. ``computed`` counts tokens with KV."""

    rid: str
    prompt_tokens: int
    max_tokens: int
    arrival: float = 0.0
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def pending(self) -> int:
        return self.num_tokens - self.computed

    @property
    def done(self) -> bool:
        return self.finished_at is not None or self.aborted


@dataclass
class StepPlan:
    """What one engine step computes: ``(request, new tokens)`` pairs and its duration."""

    batch: list[tuple[SimRequest, int]]
    start: float
    duration: float
    preempted: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.batch)


@dataclass
class StepResult:
    emitted: list[SimRequest]  # each produced exactly one output token this step
    finished: list[SimRequest]


class Engine:
    """One simulated vLLM engine on one GPU."""

    def __init__(self, gpu: GpuProfile, model: ModelProfile,
                 efficiency: Efficiency | None = None, *,
                 clock: Callable[[], float], slow: float = 1.0,
                 max_model_len: int | None = None) -> None:
        if slow <= 0:
            raise ValueError("slow factor must be positive")
        self.gpu, self.model = gpu, model
        self.eff = efficiency or Efficiency()
        self.clock, self.slow = clock, slow
        self.kv_capacity_tokens = kv_capacity_tokens(gpu, model)
        self.total_blocks = self.kv_capacity_tokens // gpu.block_size
        self.free_blocks = self.total_blocks
        limit = min(model.max_context, self.kv_capacity_tokens)
        self.max_model_len = min(max_model_len or limit, model.max_context)
        if self.max_model_len > self.kv_capacity_tokens:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV cache of "
                             f"{self.kv_capacity_tokens} tokens on {gpu.name}")
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        # Preempted requests whose freed blocks still hold their KV, oldest first.
        self._cached: dict[SimRequest, int] = {}
        self._cached_total = 0
        self.stats = EngineStats()
        self._busy: deque[tuple[float, float]] = deque()
        self._completions: deque[float] = deque()

    # ---- inspection -------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def validate(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why vLLM would reject this request with HTTP 400, or ``None``."""
        if prompt_tokens < 1:
            return "prompt must contain at least one token"
        if max_tokens < 1:
            return "max_tokens must be at least 1"
        if prompt_tokens + max_tokens > self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {prompt_tokens + max_tokens} tokens "
                    f"({prompt_tokens} in the messages, {max_tokens} in the completion).")
        return None

    def busy_fraction(self, now: float | None = None, window: float = BUSY_WINDOW_S) -> float:
        """Fraction of the last ``window`` seconds the GPU spent executing steps."""
        now = self.clock() if now is None else now
        lo = now - window
        while self._busy and self._busy[0][1] <= lo:
            self._busy.popleft()
        busy = sum(max(0.0, min(end, now) - max(start, lo)) for start, end in self._busy)
        return min(1.0, busy / window)

    def completion_rate(self, now: float | None = None, window: float = RATE_WINDOW_S) -> float:
        """Completed requests per second over the last ``window`` seconds."""
        now = self.clock() if now is None else now
        while self._completions and self._completions[0] <= now - window:
            self._completions.popleft()
        return len(self._completions) / window

    # ---- request lifecycle ------------------------------------------------------------
    def submit(self, req: SimRequest, now: float | None = None) -> None:
        req.arrival = self.clock() if now is None else now
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        """Drop a request (client went away): free its KV, forget it. Idempotent."""
        if req.done:
            return
        req.aborted = True
        if req in self.running:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self._cached_total -= self._cached.pop(req, 0)
        self._free(req)

    # ---- stepping ---------------------------------------------------------------------
    def plan_step(self, now: float | None = None) -> StepPlan | None:
        """Choose the next batch; ``None`` when there is nothing to run."""
        now = self.clock() if now is None else now
        budget = self.gpu.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        preempted = self._schedule_running(batch, budget)
        budget -= sum(n for _, n in batch)
        if not preempted:
            self._admit_waiting(batch, budget, now)
        if not batch:
            return None
        duration = self.step_time(batch)
        self._busy.append((now, now + duration))
        return StepPlan(batch=batch, start=now, duration=duration, preempted=preempted)

    def finish_step(self, plan: StepPlan, now: float | None = None) -> StepResult:
        """Apply a planned step: advance KV, sample tokens, retire finished requests."""
        now = plan.start + plan.duration if now is None else now
        emitted: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req, n in plan.batch:
            if req.aborted:
                continue
            req.computed += n
            if req.computed < req.num_tokens:
                continue  # a prompt chunk, or a recompute, that has not reached the end yet
            self._sample(req, now)
            emitted.append(req)
            if req.generated >= req.max_tokens:
                self._finish(req, now)
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if not r.done]
        return StepResult(emitted=emitted, finished=finished)

    def step_time(self, batch: Iterable[tuple[SimRequest, int]]) -> float:
        """Roofline time of one step (see the module docstring)."""
        m, g, e = self.model, self.gpu, self.eff
        tokens = ctx = 0
        attn = 0.0
        for req, n in batch:
            tokens += n
            ctx += req.computed + n
            attn += n * (req.computed + n / 2)
        read_bytes = m.weight_bytes + ctx * m.kv_bytes_per_token
        flops = 2.0 * m.params * tokens + 4.0 * m.n_layers * m.hidden * attn
        roof = max(read_bytes / (g.mem_bandwidth * e.mbu), flops / (g.peak_flops * e.mfu))
        return (e.step_overhead_s + roof) * self.slow

    # ---- internals --------------------------------------------------------------------
    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.gpu.block_size)

    def _schedule_running(self, batch: list[tuple[SimRequest, int]], budget: int) -> int:
        """Schedule running requests in order; returns how many were preempted."""
        preempted, i = 0, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.pending, budget)
            need = self._blocks_for(req.computed + n) - req.blocks
            while need > self.free_blocks:
                victim = self.running.pop()  # the newest request
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    return preempted
            self._take(req, need)
            batch.append((req, n))
            budget -= n
            i += 1
        return preempted

    def _admit_waiting(self, batch: list[tuple[SimRequest, int]], budget: int,
                       now: float) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.gpu.max_num_seqs:
            req = self.waiting[0]
            cached = self._cached.get(req, 0)
            computed = min(cached * self.gpu.block_size, req.num_tokens - 1)
            n = min(req.num_tokens - computed, budget)
            need = self._blocks_for(computed + n)
            if need > self.free_blocks:
                return  # FCFS: the head of the queue waits for KV, and so does everyone else
            self.waiting.popleft()
            self._cached_total -= self._cached.pop(req, 0)
            req.computed = computed
            self._take(req, need)
            if req.scheduled_at is None:
                req.scheduled_at = now
            self.running.append(req)
            batch.append((req, n))
            budget -= n

    def _take(self, req: SimRequest, need: int) -> None:
        """Give ``req`` ``need`` more blocks, evicting cached blocks of preempted requests."""
        evict = need - (self.free_blocks - self._cached_total)
        while evict > 0:
            victim = next(iter(self._cached))
            gone = min(evict, self._cached[victim])
            self._cached[victim] -= gone
            self._cached_total -= gone
            evict -= gone
            if self._cached[victim] == 0:
                del self._cached[victim]
        self.free_blocks -= need
        req.blocks += need

    def _preempt(self, req: SimRequest) -> None:
        if req.computed >= self.gpu.block_size:
            blocks = req.computed // self.gpu.block_size  # only full blocks are cacheable
            self._cached[req] = blocks
            self._cached_total += blocks
        self._free(req)
        req.computed = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _free(self, req: SimRequest) -> None:
        self.free_blocks += req.blocks
        req.blocks = 0

    def _sample(self, req: SimRequest, now: float) -> None:
        stats = self.stats
        if req.first_token_at is None:
            req.first_token_at = now
            stats.prompt_tokens += req.prompt_tokens
            stats.ttft.observe(now - req.arrival)
        else:
            stats.itl.observe(now - (req.last_token_at or now))
        req.last_token_at = now
        req.generated += 1
        stats.generation_tokens += 1

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finished_at = now
        self._free(req)
        self.stats.success += 1
        self.stats.e2e.observe(now - req.arrival)
        self._completions.append(now)


# ---- virtual time ---------------------------------------------------------------------
class ManualClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def set(self, t: float) -> None:
        self.now = max(self.now, t)


def run_virtual(engine: Engine, clock: ManualClock,
                arrivals: Iterable[tuple[float, SimRequest]],
                until: float | None = None) -> None:
    """Run ``engine`` in virtual time until every request finished (or ``until``)."""
    pending = deque(sorted(arrivals, key=lambda a: a[0]))
    while until is None or clock.now < until:
        while pending and pending[0][0] <= clock.now:
            t, req = pending.popleft()
            engine.submit(req, now=t)
        plan = engine.plan_step()
        if plan is None:
            if not pending:
                return
            clock.set(pending[0][0])
            continue
        clock.set(plan.start + plan.duration)
        engine.finish_step(plan)


@dataclass(frozen=True)
class Capacity:
    """Sustained throughput of one engine when its queue never runs dry."""

    gpu: str
    req_per_s: float
    output_tokens_per_s: float


def estimate_capacity(gpu: GpuProfile, model: ModelProfile,
                      samples: Sequence[tuple[int, int]],
                      efficiency: Efficiency | None = None) -> Capacity:
    """Saturated throughput for a request mix of ``(prompt_tokens, max_tokens)`` pairs.

    Every request is queued at t=0; the rate is measured between the 10th and 90th
    percentile completions so the ramp-up and the draining tail do not count.
    """
    if len(samples) < 10:
        raise ValueError("need at least 10 samples")
    clock = ManualClock()
    engine = Engine(gpu, model, efficiency, clock=clock)
    reqs = [SimRequest(f"cap-{i}", p, m) for i, (p, m) in enumerate(samples)
            if engine.validate(p, m) is None]
    run_virtual(engine, clock, ((0.0, r) for r in reqs))
    ends = sorted(r.finished_at for r in reqs if r.finished_at is not None)
    lo, hi = len(ends) // 10, (len(ends) * 9) // 10
    span = ends[hi] - ends[lo]
    rps = (hi - lo) / span if span > 0 else float("inf")
    mean_out = sum(r.max_tokens for r in reqs) / len(reqs)
    return Capacity(gpu=gpu.name, req_per_s=rps, output_tokens_per_s=rps * mean_out)
