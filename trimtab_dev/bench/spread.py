"""Several seeds of one bench: each ratio's min, median and max over the seeds, and how many
seeds met each target (``spread.json`` and the spread table)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trimtab_dev.bench.report import fmt_x, plain_table


# ---- several seeds ------------------------------------------------------------------------
def _stats(values: Sequence[float | None]) -> dict[str, float | int | None]:
    """min / median / max of the known values (None when there is none), and their count."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return {"min": None, "median": None, "max": None, "n": 0}
    mid = len(known) // 2
    median = known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2
    return {"min": known[0], "median": median, "max": known[-1], "n": len(known)}


def spread(docs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Across the ``{seed: bench.json}`` runs: min/median/max of every ratio of every policy,
    and of every target's value with the number of seeds on which it was met."""
    cmps = [doc["comparison"] for doc in docs.values()]
    ratios: dict[str, dict[str, Any]] = {}
    for cmp in cmps:
        for policy, row in cmp["ratios"].items():
            for key in row:
                ratios.setdefault(policy, {}).setdefault(key, None)
    for policy, keys in ratios.items():
        for key in keys:
            keys[key] = _stats([c["ratios"].get(policy, {}).get(key) for c in cmps])
    goals: dict[str, dict[str, Any]] = {}
    for cmp in cmps:
        for t in cmp["targets"]:
            goals.setdefault(t["name"], {"what": t["what"], "op": t["op"], "limit": t["limit"],
                                         "values": [], "met": 0, "of": 0})
            goal = goals[t["name"]]
            goal["values"].append(t["value"])
            goal["met"] += t["met"] is True
            goal["of"] += t["met"] is not None
    for goal in goals.values():
        goal.update(_stats(goal.pop("values")))
    out = {"seeds": list(docs), "ratios": ratios, "targets": goals}
    if any("surge" in cmp for cmp in cmps):
        out["surge"] = surge_spread(cmps)
    return out


SURGE_FIGURES = ("goodput", "good_tokens_per_s", "served_ttft_p99", "refused", "refusal_p99",
                 "refusals_openai_retry_after_fraction", "recovery_s",
                 "after_surge_within_slo", "errors")


def surge_spread(cmps: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy, min/median/max over the seeds of every surge figure (recovery_s: over
    the seeds that recovered; ``n`` says how many)."""
    policies = {p: None for cmp in cmps for p in cmp.get("surge", {}).get("metrics", {})}
    return {p: {key: _stats([cmp["surge"]["metrics"][p][key] for cmp in cmps
                             if p in cmp.get("surge", {}).get("metrics", {})])
                for key in SURGE_FIGURES}
            for p in policies}


SPREAD_COLUMNS = ("policy", "ratio", "min", "median", "max", "seeds")
SPREAD_TABLE = ("ttft_p50", "ttft_p99", "output_tokens_per_s", "goodput",
                "good_tokens_per_s")  # the rest: spread.json


def spread_rows(doc: Mapping[str, Any]) -> list[list[str]]:
    """The table's rows: P50/P99 TTFT and tokens/s ratios, without a policy against itself."""
    rows = []
    for policy, keys in doc["ratios"].items():
        for key, st in keys.items():
            metric, _, base = key.partition("_vs_")
            if st["n"] and metric in SPREAD_TABLE and base != policy:
                rows.append([policy, key, fmt_x(st["min"]), fmt_x(st["median"]),
                             fmt_x(st["max"]), str(st["n"])])
    return rows


def num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def spread_lines(doc: Mapping[str, Any]) -> list[str]:
    def verdict(g: Mapping[str, Any]) -> str:
        return f"met on {g['met']} of {g['of']} seeds" if g["of"] else "n/a"
    return [f"{g['what']}: min {num(g['min'])} / median {num(g['median'])} / max "
            f"{num(g['max'])} (target {g['op']} {g['limit']:g}) -> {verdict(g)}"
            for g in doc["targets"].values()]


def print_spread(doc: Mapping[str, Any]) -> None:
    seeds = ",".join(map(str, doc["seeds"]))
    print(f"\nspread over seeds {seeds}\n{plain_table(SPREAD_COLUMNS, spread_rows(doc))}")
    if doc.get("surge"):
        rows = [[p, key, *(num(st[k]) for k in ("min", "median", "max")), str(st["n"])]
                for p, keys in doc["surge"].items() for key, st in keys.items() if st["n"]]
        print(f"\nsurge figures over seeds {seeds}\n"
              f"{plain_table(('policy', 'figure', 'min', 'median', 'max', 'seeds'), rows)}")
    print("\n".join(["", *spread_lines(doc)]), flush=True)
