"""`trimtab weights --config PATH`: read telemetry once and show why each weight is what it is."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .cache import SnapshotCache
from .config import Config
from .controller import Controller

_COLUMNS = ("pool", "cluster", "endpoint", "weight", "health", "stale", "capacity", "inputs",
            "normalised", "shares", "reason")


def _fmt(values: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.3g}" for k, v in sorted(values.items())) or "-"


def _prefixed(breakdown: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in breakdown.items() if k.startswith(prefix)}


def explain_rows(controller: Controller) -> list[dict[str, Any]]:
    rows = []
    for pool in controller.config.pools:
        for cluster, _, endpoints in pool.clusters():
            computed = controller.weights.get(cluster)
            for endpoint in endpoints:
                ew = computed.endpoints.get(endpoint.address) if computed else None
                breakdown = dict(ew.breakdown) if ew else {}
                rows.append({
                    "pool": pool.name, "cluster": cluster, "endpoint": endpoint.address,
                    "weight": ew.weight if ew else None, "health": ew.health if ew else "-",
                    "stale": ew.stale if ew else True,
                    "capacity": breakdown.get("relative_capacity", endpoint.capacity),
                    "inputs": _prefixed(breakdown, "input.") or (dict(ew.signals) if ew else {}),
                    "normalised": _prefixed(breakdown, "norm."),
                    "shares": _prefixed(breakdown, "share."),
                    "reason": ew.reason if ew else "no telemetry",
                })
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    cells = [[str(row[c]) if not isinstance(row[c], dict) else _fmt(row[c]) for c in _COLUMNS]
             for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c)
              for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


async def _explain(config: Config) -> list[dict[str, Any]]:
    controller = Controller(config, SnapshotCache())
    try:
        controller.ingest(await controller.collect())
    finally:
        await controller.close()
    return explain_rows(controller)


def explain(config: Config, as_json: bool = False) -> str:
    rows = asyncio.run(_explain(config))
    return json.dumps(rows, indent=1, sort_keys=True) if as_json else render_table(rows)
