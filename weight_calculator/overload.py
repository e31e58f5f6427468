"""Sustained overload: when more arrives than the pool completes, where the excess goes. Pure.

**Detection** (:func:`pool_excess`), in requests over the readings of the last ``window``
seconds, summed over the pool's usable endpoints: ``D`` requests finished and ``G`` the
growth of the requests held (running + waiting, last read minus first). What arrived is
``D + G`` (:attr:`Excess.arrival_rate` per second). The backlog is **growing past what the
pool serves** (:attr:`Excess.overloaded`) when both

* the growth is more than Poisson noise in what arrived explains (``G > 2 sqrt(D + G)``),
  so a pool at steady load, whose count wanders, is not; and
* the pool holds more requests than it finished in the whole window (``N > D``, with ``N``
  the count held at the last reads): at the pool's completion rate its backlog takes longer
  than the window to clear, so it is not a burst the next quiet seconds drain.

The queueing policy (:mod:`weight_calculator.queueing`) treats the pool as overloaded while
that holds and either the previous tick was, or the reads cover a whole window and every
endpoint outside the slowest tier was full (requests waiting, or its KV cache) through all
of it: a pool filling from idle, whose count grows for want of completions yet, and one
endpoint's queue are not overload (the count-based test alone also fires on those). The
slowest tier is left out of that test because the split itself may have starved it.

**Where it goes** (:func:`overload_split`). An engine sent more than its service rate does
not only queue the excess: it admits it into its batch while its KV cache has room, and with
chunked prefill every step then carries a full prefill budget, so each running request
advances one token per slow step and the engine finishes almost nothing until its KV cache is
full (the evidence: docs/results/overload-regression.md). Some arrivals cannot be served in
time whatever the split, so the split chooses which endpoints run past their rate: every
endpoint gets its service rate's share of what the pool completes, ``(1 - f) mu_i / M``, and the whole excess ``f`` goes to
the capacity tier with the smallest service rate per endpoint, whose capacity is the least
to lose. With one tier (identical servers) that is the split in proportion to the rates.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from weight_calculator.service_rate import Reading

NOISE_SIGMAS = 2.0  # the growth must exceed this many Poisson deviations of the arrivals


@dataclass(frozen=True, slots=True)
class Excess:
    """What the pool's readings say about its load over the window (requests)."""

    finished: float  # D: requests finished in the window
    growth: float  # G: requests held at the last reads minus at the first
    held: float  # N: requests held at the last reads
    span: float = 0.0  # seconds between the first and last reads (the longest endpoint's)

    @property
    def arrived(self) -> float:
        return self.finished + self.growth

    @property
    def arrival_rate(self) -> float:
        """Requests per second that arrived (0 without a span)."""
        return self.arrived / self.span if self.span > 0 else 0.0

    @property
    def share(self) -> float:
        """``f``: the share of the arrivals the pool did not serve (0 when none arrived)."""
        return max(0.0, self.growth) / self.arrived if self.arrived > 0 else 0.0

    @property
    def overloaded(self) -> bool:
        return (self.growth > NOISE_SIGMAS * math.sqrt(max(self.arrived, 0.0))
                and self.held > self.finished)


def pool_excess(readings: Mapping[str, Sequence[Reading]], addresses: Collection[str],
                now: float, window: float) -> Excess | None:
    """The pool's finished requests and growth over ``[now - window, now]`` for
    ``addresses``; None when no endpoint has two reads with the request counter in it. A
    counter that went backwards (a restart) counts nothing for that interval."""
    finished = growth = held = span = 0.0
    seen = False
    for address in addresses:
        points = sorted((r for r in readings.get(address, ())
                         if now - window <= r.at <= now and r.requests_done is not None),
                        key=lambda r: r.at)
        if len(points) < 2:
            continue
        seen = True
        for a, b in zip(points, points[1:], strict=False):
            assert a.requests_done is not None and b.requests_done is not None
            finished += max(0.0, b.requests_done - a.requests_done)
        first, last = points[0], points[-1]
        growth += (last.running + last.waiting) - (first.running + first.waiting)
        held += last.running + last.waiting
        span = max(span, last.at - first.at)
    return Excess(finished, growth, held, span) if seen else None


def _groups(mu: Mapping[str, float], tiers: Mapping[str, str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for a, m in sorted(mu.items()):
        if m > 0:
            groups.setdefault(tiers.get(a, a), []).append(a)
    return groups


def slowest_tier(mu: Mapping[str, float], tiers: Mapping[str, str]) -> frozenset[str]:
    """The members of the tier with the smallest mean rate per endpoint (ties: by name),
    among endpoints with a positive rate; an address missing from ``tiers`` is its own."""
    groups = _groups(mu, tiers)
    if not groups:
        return frozenset()
    return frozenset(groups[min(groups, key=lambda t: (
        sum(mu[a] for a in groups[t]) / len(groups[t]), t))])


def overload_split(mu: Mapping[str, float], tiers: Mapping[str, str],
                   finished: Mapping[str, float], work: Mapping[str, float],
                   arrival_rate: float) -> dict[str, float]:
    """Each endpoint's share (fractions summing to 1) of an overloaded pool's arrivals
    (module docstring). ``mu``: service rates (tokens/s); ``finished`` and ``work``: each
    endpoint's requests finished and tokens computed in the window; ``arrival_rate``: the
    pool's arrivals (requests/s); ``tiers``: address -> tier (an address missing from it
    is a tier of its own).

    A tier other than the slowest gets ``kappa / arrival_rate`` with ``kappa = mu_t x D_t / W_t``
    its service rate in requests (its rate over its own work per finished request), never
    more than its share of the capacity ``mu_t / M``; a tier that computed nothing in the
    window gets ``mu_t / M``. The slowest tier gets the rest, at least its own ``mu_t / M``.
    Inside a tier, in proportion to the members' rates."""
    total = sum(m for m in mu.values() if m > 0)
    if total <= 0 or arrival_rate <= 0:
        return {a: (m / total if total > 0 else 1.0 / len(mu)) for a, m in mu.items()}
    groups = _groups(mu, tiers)
    sink = slowest_tier(mu, tiers)
    tier_share: dict[str, float] = {}
    sink_tier = next(t for t, addrs in groups.items() if addrs[0] in sink)
    for t, addrs in groups.items():
        rate = sum(mu[a] for a in addrs)
        done = sum(work.get(a, 0.0) for a in addrs)
        proportional = rate / total
        if t == sink_tier:
            continue
        if done <= 0:
            tier_share[t] = proportional
        else:
            kappa = rate * sum(finished.get(a, 0.0) for a in addrs) / done
            tier_share[t] = min(proportional, kappa / arrival_rate)
    sink_rate = sum(mu[a] for a in sink)
    tier_share[sink_tier] = max(sink_rate / total, 1.0 - sum(tier_share.values()))
    norm = sum(tier_share.values())
    out = {a: 0.0 for a in mu}
    for t, addrs in groups.items():
        rate = sum(mu[a] for a in addrs)
        for a in addrs:
            out[a] = tier_share[t] / norm * mu[a] / rate
    return out
