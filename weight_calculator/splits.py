"""How a pool's arrival rate is shared among endpoints of known service rates. Pure.

``square_root`` minimises the mean sojourn time of independent M/M/1 queues; ``equal_spare``
maximises the smallest spare rate, which sets the tail of the response time (see each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping


def square_root_split(mu: Mapping[str, float], lam: float) -> dict[str, float]:
    """Arrival rate per endpoint minimising the mean sojourn time of independent M/M/1
    queues with service rates ``mu`` under total arrival rate ``lam``:
    ``r_i = mu_i - sqrt(mu_i) * (M - lam) / sum(sqrt(mu))`` over the endpoints that keep a
    positive share (the others get 0). Proportional to ``mu`` when ``lam >= M``."""
    active = {a: m for a, m in mu.items() if m > 0}
    total = sum(active.values())
    if not active or lam >= total:
        return {a: (m if m > 0 else 0.0) for a, m in mu.items()}
    while True:
        spare = sum(active.values()) - lam
        roots = sum(math.sqrt(m) for m in active.values())
        split = {a: m - math.sqrt(m) * spare / roots for a, m in active.items()}
        dropped = [a for a, r in split.items() if r <= 0]
        if not dropped or len(dropped) == len(split):
            break
        for a in dropped:
            del active[a]
    return {a: max(0.0, split.get(a, 0.0)) for a in mu}


def equal_spare_split(mu: Mapping[str, float], lam: float) -> dict[str, float]:
    """Arrival rate per endpoint that leaves every endpoint it uses the same spare rate:
    ``r_i = mu_i - (sum(mu) - lam) / n`` over the ``n`` endpoints that keep a positive share
    (an endpoint slower than that spare gets 0). An M/M/1 queue's response time has tail
    ``exp(-(mu - r) t)``, so the mixture's tail is set by the smallest ``mu_i - r_i``: this
    split maximises it, i.e. minimises the pool's tail latency (the square-root rule
    minimises the mean). Proportional to ``mu`` when ``lam >= sum(mu)``."""
    active = {a: m for a, m in mu.items() if m > 0}
    if not active or lam >= sum(active.values()):
        return {a: (m if m > 0 else 0.0) for a, m in mu.items()}
    while True:
        spare = (sum(active.values()) - lam) / len(active)
        split = {a: m - spare for a, m in active.items()}
        dropped = [a for a, r in split.items() if r <= 0]
        if not dropped or len(dropped) == len(split):
            break
        for a in dropped:
            del active[a]
    return {a: max(0.0, split.get(a, 0.0)) for a in mu}


Split = Callable[[Mapping[str, float], float], dict[str, float]]
SPLITS: dict[str, Split] = {"square_root": square_root_split, "equal_spare": equal_spare_split}
