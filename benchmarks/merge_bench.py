"""Merge `trimtab bench` runs of different policies on the same fleet, workload and seeds
into one comparison, then recompute every summary, ratio and target from the records.

    python -m benchmarks.merge_bench OUT RUN_A RUN_B [RUN_C ...]

Each RUN is a bench output directory (one run, or ``seed-*`` runs). Runs must agree on the
fleet, the workload, the rate, the duration, the warm-up and the seed: only the policies may
differ (a policy found twice is refused). Use it when the baselines were run once and the
policy under test is run again after a change: every policy still ran alone on the machine,
each at its own time, as within one bench run.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from trimtab_dev.bench.cli import report_only, seed_dirs

SAME = ("fleet", "workload", "rate", "duration", "warmup", "seed", "tail")


def _runs(path: Path) -> dict[int | None, Path]:
    if (path / "bench.json").exists():
        return {None: path}
    runs: dict[int | None, Path] = {seed: run for seed, run in seed_dirs(path).items()}
    if not runs:
        raise ValueError(f"no bench.json in {path} nor in {path}/seed-*")
    return runs


def merge_one(out: Path, parts: list[Path]) -> None:
    """One merged run in ``out`` from the runs ``parts`` (same seed)."""
    docs = [json.loads((p / "bench.json").read_text()) for p in parts]
    first = docs[0]
    for doc, part in zip(docs[1:], parts[1:], strict=True):
        differ = [k for k in SAME if doc["config"].get(k) != first["config"].get(k)]
        if differ:
            raise ValueError(f"{part} differs from {parts[0]} in {differ}")
    merged: dict[str, Any] = {**first, "policies": {}}
    out.mkdir(parents=True, exist_ok=True)
    for doc, part in zip(docs, parts, strict=True):
        for policy, entry in doc["policies"].items():
            if policy in merged["policies"]:
                raise ValueError(f"policy {policy!r} is in two of the runs")
            merged["policies"][policy] = entry
            shutil.copy(part / f"records-{policy}.jsonl", out / f"records-{policy}.jsonl")
    merged["config"] = {**first["config"], "out": str(out),
                        "merged_from": [str(p) for p in parts]}
    (out / "bench.json").write_text(json.dumps(merged, indent=1))


def merge(out: Path, runs: list[Path]) -> None:
    found = [_runs(r) for r in runs]
    seeds = set(found[0])
    if any(set(f) != seeds for f in found[1:]):
        raise ValueError(f"the runs hold different seeds: {[sorted(map(str, f)) for f in found]}")
    for seed in seeds:
        target = out if seed is None else out / f"seed-{seed}"
        merge_one(target, [f[seed] for f in found])
    report_only(out)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        merge(Path(argv[0]), [Path(a) for a in argv[1:]])
    except (OSError, ValueError, KeyError) as exc:
        print(f"merge_bench: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
