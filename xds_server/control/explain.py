"""`trimtab weights --config PATH`: read telemetry and show why each weight is what it is.

Windowed decode latency (ITL) is a difference of two cumulative histogram reads, so when the
first read carries an ITL histogram a second one is taken ``sample_interval`` seconds later
(1 s by default); with an interval of 0 the table says that latency was left out.
:func:`breakdown_document` is the per-endpoint explanation `/v1/weights` serves as well.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import Mapping
from typing import Any

from weight_calculator.types import EndpointWeight
from xds_server.config.pools import EndpointConfig
from xds_server.config.schema import Config
from xds_server.control.controller import Controller
from xds_server.telemetry.scrape import ScrapeResult
from xds_server.xds.cache import SnapshotCache

DEFAULT_SAMPLE_INTERVAL = 1.0
TABLE_WIDTH = 120  # the table fits a 120-column terminal (the reason wraps in its column)
_SCORE_KEYS = ("headroom", "score", "target_weight",
               # the queueing policy's estimates (tokens/s, tokens, seconds)
               "service_rate", "throughput", "target_rate", "backlog",
               "predicted_wait_s", "saturated_seconds", "share_weight")
_ROW_ESTIMATES = ("headroom", "service_rate", "throughput", "target_rate", "backlog",
                  "predicted_wait_s")
# Short names for the signals in the table (the JSON rows keep the full ones).
_SHORT = {"memory": "mem", "queue": "q", "latency": "lat"}


def _compact(value: float) -> str:
    """3 significant digits without exponents: 0.62, 540, 2.7k, 1.05M."""
    size = abs(value)
    if size >= 1e6:
        return f"{value / 1e6:.3g}M"
    if size >= 1e3:
        return f"{value / 1e3:.3g}k"
    return f"{value:.3g}"


def _cell(row: dict[str, Any], *path: str) -> str:
    value: Any = row
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, dict):
        return " ".join(f"{_SHORT.get(k, k)}={_compact(v)}" for k, v in sorted(value.items())) \
            or "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        return _compact(float(value))
    return "-" if value is None else str(value)


def _health(row: dict[str, Any]) -> str:
    health = str(row["health"])
    return f"{health} stale" if row["stale"] and health not in ("-", "STALE") else health


# (header, cell) per policy: only what that policy weighs by. Every table starts with the
# endpoint, its locality (capacity tier = its weight), weight and health; the reason ends it.
_Column = tuple[str, Any]
_COMMON: tuple[_Column, ...] = (
    ("endpoint", lambda r: str(r["endpoint"])), ("locality", lambda r: _cell(r, "locality")),
    ("weight", lambda r: _cell(r, "weight")), ("health", _health))
_POLICY_COLUMNS: dict[str, tuple[_Column, ...]] = {
    "queueing": (("kv", lambda r: _cell(r, "inputs", "kv_usage")),
                 ("queue", lambda r: _cell(r, "inputs", "queue")),
                 ("run", lambda r: _cell(r, "inputs", "running")),
                 ("tok/s", lambda r: _cell(r, "service_rate")),
                 ("wait s", lambda r: _cell(r, "predicted_wait_s")),
                 ("kv cap", lambda r: _cell(r, "capacity_tokens"))),
    "composite": (("capacity", lambda r: _cell(r, "capacity")),
                  ("kv cap", lambda r: _cell(r, "capacity_tokens")),
                  ("normalised", lambda r: _cell(r, "normalised")),
                  ("headroom", lambda r: _cell(r, "headroom"))),
    "gpu_memory": (("gpu mem %", lambda r: _cell(r, "inputs", "gpu_mem_pct")),),
    "reference": (("kv", lambda r: _cell(r, "inputs", "kv_usage")),
                  ("queue", lambda r: _cell(r, "inputs", "queue")),
                  ("kv cap", lambda r: _cell(r, "capacity_tokens"))),
}


def table_columns(policy: str) -> list[str]:
    """The table's headers under ``policy``."""
    return [h for h, _ in (*_COMMON, *_POLICY_COLUMNS.get(policy, ()))] + ["reason"]


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
    policy = controller.config.weights.policy
    for pool in controller.config.pools:
        for cluster, _, endpoints in pool.clusters():
            computed = controller.weights.get(cluster)
            for endpoint in endpoints:
                ew = computed.endpoints.get(endpoint.address) if computed else None
                doc = breakdown_document(endpoint, ew)
                locality = ew.locality if ew else None
                rows.append({
                    "pool": pool.name, "cluster": cluster, "endpoint": endpoint.address,
                    "policy": policy, "lb_policy": pool.effective_lb_policy,
                    "locality": (f"{locality}={computed.localities.get(locality, 1)}"
                                 if locality and computed else None),
                    "weight": ew.weight if ew else None, "health": ew.health if ew else "-",
                    "stale": ew.stale if ew else True,
                    **{key: doc[key] for key in ("capacity", "capacity_tokens", "inputs",
                                                 "normalised", "shares")},
                    **{key: doc[key] for key in _ROW_ESTIMATES if key in doc},
                    "problems": list(ew.problems) if ew else [],
                    "reason": ew.reason if ew else "no telemetry",
                })
    return rows


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(width - 1, 0)] + "…"


def render_table(rows: list[dict[str, Any]], notes: list[str] | None = None,
                 width: int = TABLE_WIDTH) -> str:
    """A section per cluster, under a heading line (pool, cluster, policy, balancer): its
    endpoints in the columns their policy weighs by, the reason last. No line is longer than
    ``width``: a long reason wraps within its column, or under the row when the columns leave
    it too little room (``--json`` has every value whole)."""
    lines: list[str] = []
    clusters: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        clusters.setdefault((row["pool"], row["cluster"]), []).append(row)
    for (pool, cluster), members in clusters.items():
        policy, lb = members[0].get("policy", "-"), members[0].get("lb_policy", "-")
        where = pool if cluster == pool else f"{pool}, cluster {cluster}"
        if lines:
            lines.append("")
        lines.append(_cut(f"pool {where}: policy {policy}, lb {lb}", width))
        columns = (*_COMMON, *_POLICY_COLUMNS.get(str(policy), ()))
        table = [[h for h, _ in columns] + ["reason"]]
        table += [[cell(row) for _, cell in columns] + [str(row["reason"])] for row in members]
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        for i, line in enumerate(table):
            start = "".join(c.ljust(w + 2) for c, w in zip(line, widths, strict=False))
            lines += ([_cut(f"{start}{line[-1]}", width)] if i == 0
                      else _with_reason(start, line[-1], width))
    for note in notes or []:
        lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="      ")
    return "\n".join(lines)


MIN_REASON_WIDTH = 24
REASON_INDENT = "    "


def _with_reason(start: str, reason: str, width: int) -> list[str]:
    """The row, its reason wrapped within its column; when the other columns leave that
    column fewer than MIN_REASON_WIDTH characters (a long IPv6 endpoint), on indented lines
    of its own under the row."""
    room = width - len(start)
    if room >= MIN_REASON_WIDTH:
        parts = textwrap.wrap(reason, room) or [""]
        return [f"{start}{parts[0]}".rstrip(), *(" " * len(start) + part for part in parts[1:])]
    return [_cut(start.rstrip(), width),
            *textwrap.wrap(reason, width - len(REASON_INDENT), initial_indent=REASON_INDENT,
                           subsequent_indent=REASON_INDENT)]


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
