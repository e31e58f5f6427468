"""`trimtab load`: open-loop load against OpenAI-compatible servers; JSON report out.

Exit status: 0 when at least one request succeeded, 1 when none did, 2 on bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trimtab_dev.loadgen.report import summarize, sweep_report
from trimtab_dev.loadgen.runner import Progress, RunResult, run_load
from trimtab_dev.loadgen.workload import Workload, WorkloadError, load_workload

EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trimtab load", description=__doc__)
    p.add_argument("--target", action="append", required=True, metavar="URL",
                   help="base URL (http://host:port); repeat to spread requests in turn")
    p.add_argument("--workload", required=True, help="workload YAML")
    p.add_argument("--rate", type=float, help="override the mean arrival rate (req/s)")
    p.add_argument("--duration", type=float, help="override the duration (s)")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--sweep", help="comma-separated rates: one run per rate, then a summary")
    p.add_argument("--max-connections", type=int, help="client connection limit")
    p.add_argument("--out", help="write the JSON report here (default: stdout)")
    p.add_argument("--records", help="write one JSON line per request here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _sweep_rates(args: argparse.Namespace, w: Workload) -> list[float] | None:
    if args.sweep:
        return [float(x) for x in args.sweep.split(",") if x.strip()]
    return list(w.sweep.rates) if w.sweep else None


@contextlib.contextmanager
def _progress(enabled: bool, label: str) -> Iterator[Callable[[Progress], None] | None]:
    """A rich progress bar on stderr, or nothing when disabled / not a TTY / no rich."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar
    except ImportError:
        yield None
        return
    bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
              TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task(label, total=None, info="")

    def update(p: Progress) -> None:
        bar.update(task, total=p.total, completed=p.done,
                   info=f"sent {p.sent}/{p.total}  in-flight {p.in_flight}  errors {p.errors}")

    with bar:
        yield update


async def _run_one(args: argparse.Namespace, w: Workload, rate: float | None) -> RunResult:
    label = f"{w.name} @ {rate or args.rate or w.rate:g} req/s"
    with _progress(not args.quiet, label) as update:
        return await run_load(args.target, w, rate=rate or args.rate, duration=args.duration,
                              seed=args.seed, on_progress=update,
                              max_connections=args.max_connections)


async def _main(args: argparse.Namespace, w: Workload) -> tuple[dict[str, Any], list[Any]]:
    rates = _sweep_rates(args, w)
    if not rates:
        result = await _run_one(args, w, None)
        return summarize(result), result.records
    reports: list[dict[str, Any]] = []
    records: list[Any] = []
    duration = args.duration or (w.sweep.duration_s if w.sweep else None)
    args.duration = duration
    for rate in rates:
        result = await _run_one(args, w, rate)
        reports.append(summarize(result))
        records.extend({"offered_rate": rate, **r.to_dict()} for r in result.records)
    return sweep_report(reports), records


def _write(report: dict[str, Any], records: list[Any], args: argparse.Namespace) -> None:
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    if args.records:
        with open(args.records, "w") as f:
            for r in records:
                f.write(json.dumps(r if isinstance(r, dict) else r.to_dict()) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        w = load_workload(args.workload)
        if args.sweep:
            _sweep_rates(args, w)
    except (WorkloadError, ValueError) as exc:
        print(f"trimtab load: invalid input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    gc.freeze()  # keep import-time objects out of collections during the run
    try:
        report, records = asyncio.run(_main(args, w))
    except KeyboardInterrupt:
        return 130
    report["workload"] = {"name": w.name, "path": args.workload,
                          "seed": w.seed if args.seed is None else args.seed}
    _write(report, records, args)
    completed = (sum(r["requests"]["completed"] for r in report["runs"])
                 if report.get("mode") == "sweep" else report["requests"]["completed"])
    return 0 if completed > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
