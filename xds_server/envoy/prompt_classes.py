"""``long_context: auto``: prompt-size classes derived from the pool's KV capacities.

A prompt of ``P`` tokens holds ``P / C`` of an endpoint's KV cache of ``C`` tokens for as long
as it runs. The rule: **a prompt may take at most** :data:`KV_SHARE` **(1/8) of an endpoint's
KV cache**, so that every endpoint it reaches can still run eight such prompts at once (the
same margin as ``trimtab bench``'s ``--long-context-kv-factor 8``). Shorter prompts go
anywhere; longer ones only to the endpoints that hold them.

Endpoints are grouped into capacity tiers: sorted by capacity, an endpoint starts a new tier
when its capacity is at least :data:`TIER_RATIO` (2) times the smallest of the current tier
(so replicas of one GPU, or GPUs within a factor 2, are one tier and never split). With one
tier (a homogeneous pool) there are no classes. With tiers ``T0 < T1 < ... < Tk`` and
``b_j = KV_SHARE * min capacity of T_j`` tokens, class ``j`` (1..k) takes prompts of
``[b_(j-1), b_j)`` tokens (the last one unbounded) and sends them to the endpoints of tiers
``j..k``. Envoy matches on ``content-length``, at :data:`BYTES_PER_TOKEN` (4) bytes of JSON per
prompt token (English text; see docs/configuration.md for where that breaks).

**Prefill cap** (from measured rates, when the weights have them): a prompt of ``P`` tokens
holds an endpoint of service rate ``mu`` tokens/s for about ``P / mu`` seconds, and every
request that arrives there meanwhile waits behind it; the weights react only once a tick
(``horizon``, the telemetry interval). So a tier's bound is also at most ``mu x horizon``
tokens, ``mu`` the slowest member's rate (``service_rate`` in the weights' breakdown, else
its prior ``service_rate_used``): a prompt that would hold a small GPU longer than one tick
goes to the bigger ones. That bound is rounded down to a power of two tokens (so a rate that
wanders by a few percent does not rebuild the routes every tick) and kept while the raw
value stays within a factor ``HYSTERESIS`` of it (``previous``). Bounds never decrease from
one tier to the next.

Capacities are the endpoints' KV-cache tokens: ``vllm:cache_config_info`` (``num_gpu_blocks x
block_size``) from the last good read, else ``capacity:`` in the config. Until every endpoint
of the pool has one, no class is derived (a pool is never split on a guess). Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from weight_calculator.types import PoolWeights

KV_SHARE = 1.0 / 8.0
TIER_RATIO = 2.0
BYTES_PER_TOKEN = 4
HYSTERESIS = 1.25  # a prefill bound moves once the raw value leaves [b / 1.25, 2.5 b)
PREFIX = "trimtab-auto-"  # pool names may not start with "trimtab-": no clash possible


@dataclass(frozen=True)
class AutoClass:
    """Requests with content-length in ``[min_prompt_bytes, max_prompt_bytes)`` (no upper
    bound when None) go to ``cluster``, made of ``addresses``."""

    cluster: str
    min_prompt_bytes: int
    max_prompt_bytes: int | None
    addresses: tuple[str, ...]

    @property
    def upper(self) -> int:
        return self.max_prompt_bytes if self.max_prompt_bytes is not None else 2**63 - 1


def cluster_name(pool: str, index: int) -> str:
    return f"{PREFIX}{pool}-{index}"


def tiers(capacities: Mapping[str, float]) -> list[list[str]]:
    """Addresses grouped into capacity tiers, smallest first (see the module docstring)."""
    ordered = sorted(capacities, key=lambda a: (capacities[a], a))
    groups: list[list[str]] = []
    floor = math.inf
    for address in ordered:
        if groups and capacities[address] < TIER_RATIO * floor:
            groups[-1].append(address)
        else:
            groups.append([address])
            floor = capacities[address]
    return groups


def _valid(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def prefill_bound(rate: float, horizon: float, previous: int | None = None) -> int:
    """Prompt tokens a GPU of ``rate`` tokens/s computes in ``horizon`` seconds, rounded down
    to a power of two; ``previous`` (tokens) is kept while the raw value stays within
    ``[previous / HYSTERESIS, 2 * previous * HYSTERESIS)``."""
    raw = rate * horizon
    if previous is not None and previous / HYSTERESIS <= raw < 2 * previous * HYSTERESIS:
        return previous
    return 2 ** int(math.floor(math.log2(raw))) if raw >= 1 else 1


def derive_classes(pool: str, capacities: Mapping[str, float | None],
                   rates: Mapping[str, float | None] | None = None, horizon: float = 0.0,
                   previous: Sequence[AutoClass] = ()) -> tuple[AutoClass, ...]:
    """The pool's automatic classes; none while a capacity is unknown or invalid, or when
    every endpoint is in one tier. With ``rates`` (tokens/s, per address) and a ``horizon``
    (seconds), each tier's bound is capped by its prefill bound (module docstring);
    ``previous`` (the classes derived last) gives that cap its hysteresis."""
    known: dict[str, float] = {}
    for address, capacity in capacities.items():
        if not _valid(capacity):
            return ()
        known[address] = float(capacity or 0.0)
    groups = tiers(known)
    if len(groups) < 2:
        return ()
    before = {c.addresses: c for c in previous}
    bounds: list[int] = []
    for j, group in enumerate(groups):
        bound = int(KV_SHARE * min(known[a] for a in group))
        speeds = [float(r) for a in group
                  if (r := (rates or {}).get(a)) is not None and _valid(r)]
        if speeds and horizon > 0 and j < len(groups) - 1:
            members = tuple(sorted(a for g in groups[j + 1:] for a in g))
            prior = before.get(members)  # the class that starts at this tier's bound
            held = prior.min_prompt_bytes // BYTES_PER_TOKEN if prior is not None else None
            bound = min(bound, prefill_bound(min(speeds), horizon, held))
        bounds.append(max(bound, bounds[-1] if bounds else 0))
    bounds = [b * BYTES_PER_TOKEN for b in bounds]
    classes = []
    for j in range(1, len(groups)):
        members = tuple(sorted(a for group in groups[j:] for a in group))
        upper = bounds[j] if j < len(groups) - 1 else None
        if upper is not None and upper <= bounds[j - 1]:
            continue  # an empty size range: its tier takes no prompt of its own
        classes.append(AutoClass(cluster_name(pool, j), bounds[j - 1], upper, members))
    return tuple(classes)


def capacities_of(addresses: Sequence[str], configured: Mapping[str, float | None],
                  read: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each endpoint's KV capacity: what its server said last (``read``), else the config."""
    return {a: read.get(a) if read.get(a) is not None else configured.get(a) for a in addresses}


def service_rates_of(weights: PoolWeights | None) -> dict[str, float | None]:
    """Each endpoint's service rate (tokens/s) from the queueing weights' breakdown: measured,
    else its prior; empty under the other policies (no prefill cap)."""
    if weights is None:
        return {}
    return {a: ew.breakdown.get("service_rate", ew.breakdown.get("service_rate_used"))
            for a, ew in weights.endpoints.items()}
