"""`trimtab weights --config PATH`: read telemetry and show why each weight is what it is.

Windowed decode latency (ITL) is a difference of two cumulative histogram reads, so when the
first read carries an ITL histogram a second one is taken ``sample_interval`` seconds later
(1 s by default); with an interval of 0 the table says that latency was left out.
:func:`breakdown_document` is the per-endpoint explanation `/v1/weights` serves as well.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from weight_calculator.types import EndpointWeight
from xds_server.config.pools import EndpointConfig
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds.cache import SnapshotCache

DEFAULT_SAMPLE_INTERVAL = 1.0
_COLUMNS = ("pool", "cluster", "endpoint", "locality", "weight", "health", "stale",
            "capacity", "capacity_tokens", "inputs", "normalised", "shares", "reason")
_SCORE_KEYS = ("headroom", "score", "target_weight",
               # the queueing policy's estimates (tokens/s, tokens, seconds)
               "service_rate", "throughput", "target_rate", "backlog",
               "predicted_wait_s", "saturated_seconds", "share_weight")


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v:.3g}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def _prefixed(breakdown: Mapping[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in breakdown.items() if k.startswith(prefix)}


def _capacity_tokens(endpoint: EndpointConfig, ew: EndpointWeight | None) -> float | None:
    """KV-cache tokens: the endpoint's own signal, else the configured capacity."""
    if ew is not None:
        found = ew.breakdown.get("input.capacity", ew.signals.get("kv_capacity_tokens"))
        if found is not None:
            return found
    return endpoint.capacity


def breakdown_document(endpoint: EndpointConfig, ew: EndpointWeight | None) -> dict[str, Any]:
    """Inputs, normalised loads, mix and shares, and capacity both relative to the pool's
    largest (``capacity``, composite policy only) and in KV tokens (``capacity_tokens``)."""
    breakdown = ew.breakdown if ew is not None else {}
    return {
        "inputs": _prefixed(breakdown, "input.") or (dict(ew.signals) if ew else {}),
        "normalised": _prefixed(breakdown, "norm."),
        "mix": _prefixed(breakdown, "mix."),
        "shares": _prefixed(breakdown, "share."),
        "capacity": breakdown.get("relative_capacity"),
        "capacity_tokens": _capacity_tokens(endpoint, ew),
        **{key: breakdown[key] for key in _SCORE_KEYS if key in breakdown},
    }


def explain_rows(controller: Controller) -> list[dict[str, Any]]:
    rows = []
    for pool in controller.config.pools:
        for cluster, _, endpoints in pool.clusters():
            computed = controller.weights.get(cluster)
            for endpoint in endpoints:
                ew = computed.endpoints.get(endpoint.address) if computed else None
                doc = breakdown_document(endpoint, ew)
                locality = ew.locality if ew else None
                rows.append({
                    "pool": pool.name, "cluster": cluster, "endpoint": endpoint.address,
                    "locality": (f"{locality}={computed.localities.get(locality, 1)}"
                                 if locality and computed else None),
                    "weight": ew.weight if ew else None, "health": ew.health if ew else "-",
                    "stale": ew.stale if ew else True,
                    **{key: doc[key] for key in ("capacity", "capacity_tokens", "inputs",
                                                 "normalised", "shares")},
                    "problems": list(ew.problems) if ew else [],
                    "reason": ew.reason if ew else "no telemetry",
                })
    return rows


def render_table(rows: list[dict[str, Any]], notes: list[str] | None = None) -> str:
    cells = [[_fmt(row[c]) for c in _COLUMNS] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    lines += [f"note: {note}" for note in notes or []]
    return "\n".join(lines)


def _has_itl_histogram(results: Mapping[str, ScrapeResult]) -> bool:
    return any(r.signals is not None and r.itl is not None and "itl_ms" not in r.signals
               for r in results.values())


async def _read(controller: Controller, sample_interval: float) -> list[str]:
    """One read, or two ``sample_interval`` apart when latency needs them; the notes."""
    first = await controller.collect()
    controller.ingest(first)
    if not _has_itl_histogram(first):
        return []
    if sample_interval <= 0:
        return ["latency (itl_ms) left out: the ITL histogram needs a second read"]
    await asyncio.sleep(sample_interval)
    controller.weights = {}  # weigh the second read afresh, not smoothed from the first
    controller.ingest(await controller.collect())
    return [f"latency (itl_ms) is the mean ITL between two reads {sample_interval:g}s apart; "
            "an endpoint that produced no tokens in between shows none"]


async def collect_rows(config: Config, sample_interval: float = DEFAULT_SAMPLE_INTERVAL
                       ) -> tuple[list[dict[str, Any]], list[str]]:
    """Read telemetry as `trimtab serve` would and return (rows, notes)."""
    controller = Controller(config, SnapshotCache())
    try:
        notes = await _read(controller, sample_interval)
    finally:
        await controller.close()
    return explain_rows(controller), notes


def explain(config: Config, as_json: bool = False,
            sample_interval: float = DEFAULT_SAMPLE_INTERVAL) -> str:
    rows, notes = asyncio.run(collect_rows(config, sample_interval))
    return json.dumps(rows, indent=1, sort_keys=True) if as_json else render_table(rows, notes)
