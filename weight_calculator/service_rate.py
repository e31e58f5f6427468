"""An endpoint's throughput and service rate from its counter reads (pure; the
queueing policy's measurement, :mod:`weight_calculator.queueing` explains the method)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Reading:
    """One read of an endpoint's counters and gauges (cumulative counters, as exported)."""

    at: float  # unix seconds of the read
    requests_done: float | None  # finished requests (vllm:request_success_total)
    tokens: float | None  # prompt + generation tokens computed
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    prompt_tokens: float | None = None  # prefill tokens alone (vllm:prompt_tokens_total)

    def work(self, kind: str) -> float | None:
        """Cumulative work: ``tokens`` (prompt + generation) or ``prompt`` (prefill only)."""
        return self.prompt_tokens if kind == "prompt" else self.tokens


class RateKnobs(Protocol):
    """What :func:`rates` reads from the policy (:class:`~weight_calculator.queueing.QueueingPolicy`)."""

    @property
    def window_seconds(self) -> float: ...
    @property
    def horizon_seconds(self) -> float: ...
    @property
    def min_utilisation(self) -> float: ...
    @property
    def utilisation(self) -> str: ...
    @property
    def work(self) -> str: ...
    @property
    def kv_degraded(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Rates:
    """What an endpoint's readings in the window say."""

    throughput: float | None  # work per second actually done (tokens/s); None: no counters
    service_rate: float | None  # work per second at full utilisation; None: no evidence
    work: float  # tokens done in the window
    done: float  # requests finished in the window
    saturated_seconds: float  # time the engine was full (see ``_utilisation``)
    busy_seconds: float = 0.0  # full-utilisation-equivalent time that measured the rate
    busy_work: float = 0.0  # tokens done in that time (pooled over a tier's endpoints)


def _full(r: Reading, kv_full: float) -> bool:
    """The engine could take no more work: requests waiting, or its KV cache (nearly) full."""
    return r.waiting >= 1 or (r.kv_usage is not None and r.kv_usage >= kv_full)


def _utilisation(a: Reading, b: Reading, floor: float, mode: str = "kv",
                 kv_full: float = 1.0) -> float | None:
    """1 when the interval measured the engine at capacity, else (mode ``kv``) the mean KV use
    (None when unknown) or (modes ``queued``, ``saturated``) 0: the interval only bounds the
    rate from below.

    ``queued`` (the default): the engine was full at the start (``_full``: requests waiting,
    or no KV room) and still had work at the end, so it computed the whole interval.
    ``saturated`` (round 2) also wants it full at the end; measured on the simulator that
    biases the rate low (H100 ~18k tokens/s against 21.5k at capacity, A100 ~3.9k against
    6.7k): vLLM counts a prompt's tokens when its prefill completes, and the interval in
    which a long prefill completes is the one whose end often finds the queue drained, so
    the largest lumps of work were left out. Full at the start only: 21.0k and 7.5k."""
    if mode == "queued":
        if _full(a, kv_full) and (b.running + b.waiting) > 0:
            return 1.0
        return 0.0
    if _full(a, kv_full) and _full(b, kv_full):
        return 1.0
    if mode == "saturated":
        return 0.0
    if a.kv_usage is None or b.kv_usage is None:
        return None
    u = (a.kv_usage + b.kv_usage) / 2.0
    return u if u >= floor else 0.0


def rates(readings: Sequence[Reading], now: float, policy: RateKnobs) -> Rates:
    """Throughput and utilisation-corrected service rate over ``policy.window_seconds``.

    An interval whose counters went backwards (a restart) or whose clock did not advance is
    skipped; so is one with too little utilisation to say anything about the rate."""
    start = now - policy.window_seconds
    kind = policy.work
    points = sorted((r for r in readings if start <= r.at <= now and r.work(kind) is not None),
                    key=lambda r: r.at)
    span = work = done = busy = busy_work = saturated = 0.0
    for a, b in zip(points, points[1:], strict=False):
        dt = b.at - a.at
        wa, wb = a.work(kind), b.work(kind)
        assert wa is not None and wb is not None
        d_work = wb - wa
        d_done = (b.requests_done - a.requests_done
                  if a.requests_done is not None and b.requests_done is not None else 0.0)
        if dt <= 0 or d_work < 0 or d_done < 0:
            continue
        span += dt
        work += d_work
        done += d_done
        u = _utilisation(a, b, policy.min_utilisation, policy.utilisation, policy.kv_degraded)
        if u == 1.0:
            saturated += dt
        if u:
            busy += dt * u
            busy_work += d_work
    if span <= 0:
        return Rates(None, None, 0.0, 0.0, 0.0)
    # enough evidence: one horizon's worth of full-utilisation-equivalent busy time
    enough = busy >= policy.horizon_seconds and busy_work > 0
    service = busy_work / busy if enough else None
    return Rates(work / span, service, work, done, saturated, busy, busy_work)
