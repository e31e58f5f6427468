"""The lab's discrete-event run: one schedule through the emulated Envoy onto simulated
engines, with a controller ticking beside them. Virtual time; deterministic per seed.

Events: an arrival is picked a host by Envoy (its active count +1) and reaches the engine
``api_overhead_s`` later (the simulator's HTTP + tokeniser delay); each engine runs steps back
to back while it has work; a controller tick reads every server at that instant and its
weights reach Envoy ``push_delay`` later; a finished request leaves Envoy's active count.
Measured as the bench measures: requests scheduled after the warm-up, TTFT from arrival to
the first token, unfinished ones after ``tail`` seconds counted as such.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trimtab_dev.lab.controllers import Controller, LabServer, Push
from trimtab_dev.lab.envoy_lb import Envoy, Host
from trimtab_dev.loadgen.workload import PlannedRequest
from trimtab_dev.sim.engine import Engine, SimRequest, StepPlan
from trimtab_dev.sim.server import ServerConfig

PUSH_DELAY_S = 0.005  # tick -> Envoy holds the weights (trimtab's measured p50 is 1.5 ms)


@dataclass
class Outcome:
    """One request as the client saw it."""

    index: int
    at: float
    prompt_tokens: int
    max_tokens: int
    server: str
    ttft: float | None = None
    e2e: float | None = None


@dataclass
class RunResult:
    outcomes: list[Outcome]
    warmup: float
    duration: float
    trace: list[dict[str, Any]] = field(default_factory=list)  # per tick: weights, in flight

    def measured(self) -> list[Outcome]:
        return [o for o in self.outcomes if self.warmup <= o.at < self.warmup + self.duration]

    def summary(self) -> dict[str, Any]:
        m = self.measured()
        ttft = sorted(o.ttft for o in m if o.ttft is not None)
        done = [o for o in m if o.e2e is not None]
        out_tokens = sum(o.max_tokens for o in done)
        span = max((o.at + (o.e2e or 0.0) for o in done), default=0.0) - self.warmup
        by_server: dict[str, int] = {}
        for o in m:
            by_server[o.server] = by_server.get(o.server, 0) + 1
        return {"requests": len(m), "unfinished": len(m) - len(done),
                "ttft_p50": _quantile(ttft, 0.50), "ttft_p90": _quantile(ttft, 0.90),
                "ttft_p99": _quantile(ttft, 0.99),
                "ttft_mean": statistics.fmean(ttft) if ttft else None,
                "output_tokens_per_s": out_tokens / span if span > 0 else None,
                "share": {k: v / len(m) for k, v in sorted(by_server.items())} if m else {}}


def _quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))
    return values[k]


class World:
    def __init__(self, configs: Sequence[ServerConfig], envoy: Envoy,
                 controller: Controller, schedule: Sequence[PlannedRequest], *,
                 warmup: float, duration: float, tail: float,
                 addresses: Sequence[str], tick_phase: float = 0.0) -> None:
        self.now = 0.0
        self.envoy, self.controller = envoy, controller
        self.schedule, self.warmup, self.duration, self.tail = schedule, warmup, duration, tail
        self.servers: dict[str, LabServer] = {}
        self.busy: dict[str, bool] = {}
        for c, a in zip(configs, addresses, strict=True):
            engine = Engine(c.gpu, c.model, c.efficiency, clock=self._clock, slow=c.faults.slow,
                            max_model_len=c.max_model_len)
            self.servers[a] = LabServer(c, engine, a, uuid=f"GPU-lab-{c.name}")
            self.busy[a] = False
        self.names = {a: s.config.name for a, s in self.servers.items()}
        if hasattr(envoy, "engines"):
            envoy.engines = {a: s.engine for a, s in self.servers.items()}
            envoy.hosts = {a: Host(a) for a in self.servers}
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.outcomes: list[Outcome] = []
        self._open: dict[SimRequest, tuple[Outcome, Host, Any]] = {}
        # derived prompt-size clusters: (min tokens, max tokens or None, their own Envoy)
        self.derived: dict[str, tuple[int, int | None, Envoy]] = {}
        self.trace: list[dict[str, Any]] = []
        self._tick_phase = tick_phase

    def _clock(self) -> float:
        return self.now

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    # ---- requests -------------------------------------------------------------------------
    def _arrive(self, p: PlannedRequest) -> None:
        envoy = self._route(p.prompt_tokens)
        pick_for = getattr(envoy, "pick_for", None)
        host = pick_for(p.prompt_tokens) if pick_for else envoy.pick()
        server = self.servers[host.address]
        out = Outcome(p.index, p.at, p.prompt_tokens, p.max_tokens, server.config.name)
        self.outcomes.append(out)
        req = SimRequest(f"r{p.index}", p.prompt_tokens, p.max_tokens)
        if server.engine.validate(p.prompt_tokens, p.max_tokens) is not None:
            envoy.done(host)
            return
        self._open[req] = (out, host, envoy)
        self._at(self.now + server.config.efficiency.api_overhead_s,
                 lambda: self._submit(server, req))

    def _submit(self, server: LabServer, req: SimRequest) -> None:
        server.engine.submit(req, now=self.now)
        self.controller.report(self.now, server)  # the response headers carry ORCA
        if not self.busy[server.address]:
            self._step(server)

    def _step(self, server: LabServer) -> None:
        plan = server.engine.plan_step(now=self.now)
        self.busy[server.address] = plan is not None
        if plan is not None:
            self._at(self.now + plan.duration, lambda: self._finish(server, plan))

    def _finish(self, server: LabServer, plan: StepPlan) -> None:
        result = server.engine.finish_step(plan, now=self.now)
        for req in result.emitted:
            out = self._open[req][0]
            if out.ttft is None:
                out.ttft = self.now - out.at
        for req in result.finished:
            out, host, envoy = self._open.pop(req)
            out.e2e = self.now - out.at
            envoy.done(host)
        self._step(server)

    # ---- control --------------------------------------------------------------------------
    def _tick(self) -> None:
        servers = list(self.servers.values())
        push = self.controller.tick(self.now, servers)
        self.trace.append({"t": self.now, "weights": dict(push.weights) if push else None,
                           "health": dict(push.health) if push else None,
                           "localities": dict(push.locality_weights or {}) if push else None,
                           "in_flight": {self.names[a]: s.engine.num_running
                                         + s.engine.num_waiting
                                         for a, s in self.servers.items()}})
        if push is not None:
            self._at(self.now + PUSH_DELAY_S, functools.partial(self._apply, push))
        self._at(self.now + self.controller.interval, self._tick)

    def _apply(self, push: Push) -> None:
        self.envoy.update(push.weights, push.health, push.localities, push.locality_weights,
                          push.priorities)
        kept: dict[str, tuple[int, int | None, Envoy]] = {}
        for d in push.derived:
            old = self.derived.get(d.cluster)
            envoy = old[2] if old is not None and set(old[2].hosts) == set(d.addresses) else \
                Envoy(self.envoy.kind, d.addresses, hash(d.cluster) % 1000,
                      bias=self.envoy.bias, choices=self.envoy.choices)
            members = set(d.addresses)
            envoy.update({a: w for a, w in push.weights.items() if a in members},
                         {a: h for a, h in push.health.items() if a in members},
                         None if push.localities is None else
                         {a: loc for a, loc in push.localities.items() if a in members},
                         push.locality_weights,
                         {a: p for a, p in push.priorities.items() if a in members})
            kept[d.cluster] = (d.min_tokens, d.max_tokens, envoy)
        self.derived = kept

    def _route(self, prompt_tokens: int) -> Any:
        """The cluster a request's prompt size routes it to (Envoy matches content-length)."""
        for lo, hi, envoy in self.derived.values():
            if lo <= prompt_tokens and (hi is None or prompt_tokens < hi):
                return envoy
        return self.envoy

    def run(self) -> RunResult:
        for p in self.schedule:
            self._at(p.at, functools.partial(self._arrive, p))
        if self.controller.interval < float("inf"):
            self._at(self._tick_phase, self._tick)
        end = self.warmup + self.duration + self.tail
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            if t > end:
                break
            self.now = t
            fn()
        return RunResult(self.outcomes, self.warmup, self.duration, self.trace)
