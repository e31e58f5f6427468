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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OVERPROVISIONING = 1.4
PANIC_THRESHOLD = 0.5
HEALTHY, DEGRADED, DRAINING = "HEALTHY", "DEGRADED", "DRAINING"


@dataclass
class Host:
    address: str
    weight: int = 1
    health: str = HEALTHY
    active: int = 0  # requests in flight from this Envoy (all workers)


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
    """One worker's balancer for one cluster: ``round_robin``, ``least_request`` (with
    ``bias``) or ``weighted`` (plain EDF on the weights; what CSWRR feeds its weights to)."""

    def __init__(self, kind: str, hosts: Sequence[Host], rng: random.Random,
                 bias: float = 1.0, choices: int = 2) -> None:
        if kind not in ("round_robin", "least_request", "weighted"):
            raise ValueError(f"unknown balancer {kind!r}")
        self.kind, self.hosts, self.rng, self.bias = kind, list(hosts), rng, bias
        self.choices = choices  # least_request with equal weights: draws, 0 = full scan
        self._sets: dict[str, list[Host]] = {}
        self._edf: dict[str, Edf] = {}
        self.rebuild()

    def rebuild(self) -> None:
        """After any weight or health change (Envoy rebuilds the balancer then)."""
        self._sets = {HEALTHY: [h for h in self.hosts if h.health == HEALTHY],
                      DEGRADED: [h for h in self.hosts if h.health == DEGRADED],
                      "all": list(self.hosts)}
        self._edf = {name: Edf(hs, self._edf_weight, self.rng)
                     for name, hs in self._sets.items() if hs}

    def _edf_weight(self, h: Host) -> float:
        if self.kind == "least_request" and self.bias:
            return h.weight / (h.active + 1) ** self.bias
        return float(h.weight)

    def _which(self) -> str:
        n = len(self.hosts)
        healthy, degraded = len(self._sets[HEALTHY]), len(self._sets[DEGRADED])
        if (healthy + degraded) < PANIC_THRESHOLD * n:
            return "all"
        healthy_load = min(1.0, OVERPROVISIONING * healthy / n)
        if degraded and self.rng.random() >= healthy_load:
            return DEGRADED
        return HEALTHY if healthy else DEGRADED

    def pick(self) -> Host:
        name = self._which()
        hosts = self._sets[name]
        if self.kind == "least_request" and len({h.weight for h in hosts}) == 1:
            if self.choices <= 0:  # FULL_SCAN: the fewest active, ties at random
                low = min(h.active for h in hosts)
                return self.rng.choice([h for h in hosts if h.active == low])
            best = self.rng.choice(hosts)
            for _ in range(self.choices - 1):
                other = self.rng.choice(hosts)
                if other.active < best.active:
                    best = other
            return best
        host = self._edf[name].pick()
        assert host is not None
        return host


class Envoy:
    """The hosts of one cluster and ``workers`` balancers over them. With ``localities``
    (address -> locality) and locality weights, each worker first picks a locality by EDF
    on ``weight x min(1, 1.4 x available share)`` (Envoy's locality-weighted LB), then a
    host inside it with the cluster's policy."""

    def __init__(self, kind: str, addresses: Sequence[str], seed: int, *, workers: int = 2,
                 bias: float = 1.0, choices: int = 2) -> None:
        self.kind, self.bias, self.choices = kind, bias, choices
        self.hosts = {a: Host(a) for a in addresses}
        self.rng = random.Random(f"{seed}/envoy")
        self.worker_rngs = [random.Random(f"{seed}/worker/{i}") for i in range(workers)]
        self.localities: dict[str, str] = {}
        self.locality_weights: dict[str, float] = {}
        self.workers: list[tuple[Edf | None, dict[str, Balancer]]] = []
        self._rebuild()

    def _rebuild(self) -> None:
        groups: dict[str, list[Host]] = {}
        for a, h in self.hosts.items():
            groups.setdefault(self.localities.get(a, ""), []).append(h)
        self.workers = []
        for rng in self.worker_rngs:
            balancers = {name: Balancer(self.kind, hs, rng, self.bias, self.choices)
                         for name, hs in groups.items()}
            edf = None
            if len(groups) > 1:
                def lw(h: Host, groups: dict[str, list[Host]] = groups) -> float:
                    hs = groups[h.address]
                    up = sum(1 for x in hs if x.health != DRAINING) / len(hs)
                    return self.locality_weights.get(h.address, 1.0) * min(1.0, OVERPROVISIONING * up)
                fake = [Host(name) for name in groups]
                edf = Edf([f for f in fake if lw(f) > 0], lw, rng)
            self.workers.append((edf, balancers))

    def update(self, weights: Mapping[str, int], health: Mapping[str, str] | None = None,
               localities: Mapping[str, str] | None = None,
               locality_weights: Mapping[str, float] | None = None) -> None:
        changed = False
        for address, w in weights.items():
            h = self.hosts[address]
            new_health = (health or {}).get(address, HEALTHY)
            if h.weight != w or h.health != new_health:
                h.weight, h.health, changed = max(1, int(w)), new_health, True
        if localities is not None and (dict(localities) != self.localities
                                       or dict(locality_weights or {}) != self.locality_weights):
            self.localities = dict(localities)
            self.locality_weights = dict(locality_weights or {})
            changed = True
        if changed:
            self._rebuild()

    def pick(self) -> Host:
        edf, balancers = self.rng.choice(self.workers)
        if edf is None:
            host = next(iter(balancers.values())).pick()
        else:
            chosen = edf.pick()
            assert chosen is not None
            host = balancers[chosen.address].pick()
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

    def update(self, weights: Mapping[str, int], health: Mapping[str, str] | None = None
               ) -> None:
        return None

    def done(self, host: Host) -> None:
        host.active -= 1
