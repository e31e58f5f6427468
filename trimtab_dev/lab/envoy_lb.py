"""Envoy's host picking, emulated (no Envoy runs in the lab).

What is modelled, from Envoy's load balancers (source/extensions/load_balancing_policies/
{round_robin,least_request,client_side_weighted_round_robin} and the EDF scheduler):

* **EDF.** Weighted round robin is an earliest-deadline-first schedule: a host is re-added
  after each pick with deadline ``now + 1 / weight``; a rebuild (every host-set or weight
  change) starts from a random number of picks, as Envoy's ``createWithPicks`` does.
* **least_request.** All weights equal: power of two choices on active requests (two hosts
  drawn at random, the one with fewer active requests wins). Weights differ: EDF where the
  weight a host is re-added with is ``weight / (active + 1) ** bias``, evaluated when it is
  picked (so a host's deadline reflects its active count at its last pick).
* **Health.** EDS ``DRAINING`` hosts are never picked; ``DEGRADED`` hosts only take the
  share the healthy ones cannot (overprovisioning factor 1.4); below half of the hosts
  available the cluster is in panic and every host is eligible.
* **Workers.** Each Envoy worker has its own balancer (schedule and random draws); the
  active request counts are per host and shared, as in Envoy.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weight_calculator.localities import OVERPROVISIONING

PANIC_THRESHOLD = 0.5
HEALTHY, DEGRADED, DRAINING = "HEALTHY", "DEGRADED", "DRAINING"


@dataclass
class Host:
    address: str
    weight: int = 1
    health: str = HEALTHY
    active: int = 0  # requests in flight from this Envoy (all workers)
    priority: int = 0


class Edf:
    """Envoy's EDF scheduler over a fixed host list, weights evaluated on re-insertion."""

    def __init__(self, hosts: Sequence[Host], weight: Callable[[Host], float],
                 rng: random.Random) -> None:
        self._weight = weight
        self._now = 0.0
        self._seq = 0
        self._heap: list[tuple[float, int, Host]] = []
        for h in hosts:
            self._add(h)
        for _ in range(rng.randrange(max(1, len(hosts)))):  # createWithPicks
            self.pick()

    def _add(self, h: Host) -> None:
        w = max(self._weight(h), 1e-9)
        self._seq += 1
        heapq.heappush(self._heap, (self._now + 1.0 / w, self._seq, h))

    def pick(self) -> Host | None:
        if not self._heap:
            return None
        deadline, _, h = heapq.heappop(self._heap)
        self._now = deadline
        self._add(h)
        return h


class Balancer:
    """One worker's picker over a fixed host list: ``round_robin``, ``least_request`` (with
    ``bias`` and ``choices``) or ``weighted`` (plain EDF on the weights; what CSWRR feeds its
    weights to)."""

    def __init__(self, kind: str, hosts: Sequence[Host], rng: random.Random,
                 bias: float = 1.0, choices: int = 2) -> None:
        if kind not in ("round_robin", "least_request", "weighted"):
            raise ValueError(f"unknown balancer {kind!r}")
        self.kind, self.hosts, self.rng, self.bias = kind, list(hosts), rng, bias
        self.choices = choices  # least_request with equal weights: draws, 0 = full scan
        self.equal = len({h.weight for h in self.hosts}) <= 1
        self._edf = None if self.equal and kind == "least_request" else Edf(
            self.hosts, self._edf_weight, rng)

    def _edf_weight(self, h: Host) -> float:
        if self.kind == "least_request" and self.bias:
            return h.weight / (h.active + 1) ** self.bias
        return float(h.weight)

    def pick(self) -> Host:
        if self._edf is None:  # least_request, equal weights: N random choices
            if self.choices <= 0:  # FULL_SCAN: the fewest active, ties at random
                low = min(h.active for h in self.hosts)
                return self.rng.choice([h for h in self.hosts if h.active == low])
            best = self.rng.choice(self.hosts)
            for _ in range(self.choices - 1):
                other = self.rng.choice(self.hosts)
                if other.active < best.active:
                    best = other
            return best
        host = self._edf.pick()
        assert host is not None
        return host


class _Worker:
    """One worker's view of a cluster: per (priority, host source: healthy, degraded, or
    every host of the priority in panic) an EDF over its localities (weight x availability)
    and a picker per locality."""

    def __init__(self, envoy: Envoy, rng: random.Random) -> None:
        self.rng = rng
        self.sources: dict[tuple[int, str], tuple[Edf | None, dict[str, Balancer]]] = {}
        for priority in sorted({h.priority for h in envoy.hosts.values()}):
            hosts = [h for h in envoy.hosts.values() if h.priority == priority]
            for source in (HEALTHY, DEGRADED, "all"):
                members = [h for h in hosts if source == "all" or h.health == source]
                if members:
                    self.sources[(priority, source)] = self._build(envoy, hosts, members)

    def _build(self, envoy: Envoy, hosts: list[Host], members: list[Host]
               ) -> tuple[Edf | None, dict[str, Balancer]]:
        groups: dict[str, list[Host]] = {}
        for h in members:
            groups.setdefault(envoy.localities.get(h.address, ""), []).append(h)
        pickers = {name: Balancer(envoy.kind, hs, self.rng, envoy.bias, envoy.choices)
                   for name, hs in groups.items()}
        if len(groups) <= 1:
            return None, pickers
        totals = Counter(envoy.localities.get(h.address, "") for h in hosts)

        def weight(loc: Host) -> float:
            share = len(groups[loc.address]) / totals[loc.address]
            return (envoy.locality_weights.get(loc.address, 1.0)
                    * min(1.0, OVERPROVISIONING * share))
        return Edf([Host(name) for name in groups], weight, self.rng), pickers

    def pick(self, source: tuple[int, str]) -> Host:
        edf, pickers = self.sources[source]
        if edf is None:
            return next(iter(pickers.values())).pick()
        chosen = edf.pick()
        assert chosen is not None
        return pickers[chosen.address].pick()


class Envoy:
    """The hosts of one cluster and ``workers`` balancers over them.

    Per pick, as Envoy's priority load does: priority 0's healthy hosts take
    ``min(1, 1.4 x healthy / hosts)`` of the traffic, its DEGRADED ones up to ``1.4 x
    degraded / hosts`` of the rest, then priority 1 likewise, and whatever is left is spread
    over those loads in proportion (normalisation); a priority with under half its hosts
    healthy or degraded is in panic and every host of it, DRAINING included, is eligible.
    With ``localities`` (address -> locality) and their weights, a worker then picks a
    locality by EDF on ``weight x min(1, 1.4 x its hosts in that source / its hosts)``
    (locality-weighted LB), then a host inside it with the cluster's policy."""

    def __init__(self, kind: str, addresses: Sequence[str], seed: int, *, workers: int = 2,
                 bias: float = 1.0, choices: int = 2) -> None:
        self.kind, self.bias, self.choices = kind, bias, choices
        self.hosts = {a: Host(a) for a in addresses}
        self.rng = random.Random(f"{seed}/envoy")
        self.worker_rngs = [random.Random(f"{seed}/worker/{i}") for i in range(workers)]
        self.localities: dict[str, str] = {}
        self.locality_weights: dict[str, float] = {}
        self.workers: list[_Worker] = []
        self.loads: list[tuple[float, tuple[int, str]]] = []
        self._rebuild()

    def _rebuild(self) -> None:
        self.workers = [_Worker(self, rng) for rng in self.worker_rngs]
        self.loads = self._priority_loads()

    def _priority_loads(self) -> list[tuple[float, tuple[int, str]]]:
        loads: list[tuple[float, tuple[int, str]]] = []
        left = 1.0
        for priority in sorted({h.priority for h in self.hosts.values()}):
            hosts = [h for h in self.hosts.values() if h.priority == priority]
            n = len(hosts)
            healthy = sum(1 for h in hosts if h.health == HEALTHY)
            degraded = sum(1 for h in hosts if h.health == DEGRADED)
            if healthy + degraded < PANIC_THRESHOLD * n:
                loads.append((left, (priority, "all")))
                left = 0.0
                break
            for count, source in ((healthy, HEALTHY), (degraded, DEGRADED)):
                take = min(left, OVERPROVISIONING * count / n)
                if take > 0:
                    loads.append((take, (priority, source)))
                    left -= take
            if left <= 0:
                break
        total = sum(w for w, _ in loads)
        return [(w / total, src) for w, src in loads] if total > 0 else [(1.0, (0, "all"))]

    def update(self, weights: Mapping[str, int], health: Mapping[str, str] | None = None,
               localities: Mapping[str, str] | None = None,
               locality_weights: Mapping[str, float] | None = None,
               priorities: Mapping[str, int] | None = None) -> None:
        changed = False
        for address, w in weights.items():
            h = self.hosts[address]
            new_health = (health or {}).get(address, HEALTHY)
            new_priority = (priorities or {}).get(address, 0)
            if h.weight != w or h.health != new_health or h.priority != new_priority:
                h.weight, h.health, h.priority = max(1, int(w)), new_health, new_priority
                changed = True
        if localities is not None and (dict(localities) != self.localities
                                       or dict(locality_weights or {}) != self.locality_weights):
            self.localities = dict(localities)
            self.locality_weights = dict(locality_weights or {})
            changed = True
        if changed:
            self._rebuild()

    def _source(self) -> tuple[int, str]:
        if len(self.loads) == 1:
            return self.loads[0][1]
        u = self.rng.random()
        for load, source in self.loads:
            if u < load:
                return source
            u -= load
        return self.loads[-1][1]

    def pick(self) -> Host:
        host = self.rng.choice(self.workers).pick(self._source())
        host.active += 1
        return host

    def done(self, host: Host) -> None:
        host.active -= 1


class Oracle:
    """Not Envoy: a per-request router that sees every engine's queue (the work ahead of a
    new request, in prompt tokens not yet computed) and its prefill speed, and sends each
    request where it would start soonest; ``size_aware`` also adds the request's own prefill
    time (a prompt-size class taken to the limit). A bound for what any balancer could do,
    for comparison only."""

    def __init__(self, engines: Mapping[str, Any], size_aware: bool = False) -> None:
        self.engines = engines
        self.size_aware = size_aware
        self.hosts = {a: Host(a) for a in engines}

    @staticmethod
    def _rate(e: Any) -> float:
        m, g, f = e.model, e.gpu, e.eff
        return g.peak_flops * f.mfu / (2.0 * m.params) / e.slow

    def pick_for(self, prompt_tokens: int) -> Host:
        best, best_t = None, float("inf")
        for a, e in self.engines.items():
            ahead = sum(r.pending for r in e.waiting) + sum(
                r.pending for r in e.running if r.computed < r.prompt_tokens)
            t = (ahead + (prompt_tokens if self.size_aware else 0)) / self._rate(e)
            if e.kv_usage > 0.97:
                t += 5.0
            if t < best_t:
                best, best_t = a, t
        host = self.hosts[best]  # type: ignore[index]
        host.active += 1
        return host

    def update(self, *_: object) -> None:
        return None  # it needs no weights

    def done(self, host: Host) -> None:
        host.active -= 1
