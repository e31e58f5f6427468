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

Capacities are the endpoints' KV-cache tokens: ``vllm:cache_config_info`` (``num_gpu_blocks x
block_size``) from the last good read, else ``capacity:`` in the config. Until every endpoint
of the pool has one, no class is derived (a pool is never split on a guess). Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

KV_SHARE = 1.0 / 8.0
TIER_RATIO = 2.0
BYTES_PER_TOKEN = 4
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


def derive_classes(pool: str, capacities: Mapping[str, float | None]) -> tuple[AutoClass, ...]:
    """The pool's automatic classes; none while a capacity is unknown or invalid, or when
    every endpoint is in one tier."""
    known: dict[str, float] = {}
    for address, capacity in capacities.items():
        if capacity is None or not (math.isfinite(capacity) and capacity > 0):
            return ()
        known[address] = float(capacity)
    groups = tiers(known)
    if len(groups) < 2:
        return ()
    bounds = [int(KV_SHARE * min(known[a] for a in group)) * BYTES_PER_TOKEN
              for group in groups]
    classes = []
    for j in range(1, len(groups)):
        members = tuple(sorted(a for group in groups[j:] for a in group))
        upper = bounds[j] if j < len(groups) - 1 else None
        classes.append(AutoClass(cluster_name(pool, j), bounds[j - 1], upper, members))
    return tuple(classes)


def capacities_of(addresses: Sequence[str], configured: Mapping[str, float | None],
                  read: Mapping[str, float | None]) -> dict[str, float | None]:
    """Each endpoint's KV capacity: what its server said last (``read``), else the config."""
    return {a: read.get(a) if read.get(a) is not None else configured.get(a) for a in addresses}
