"""`python -m trimtab_dev.demo.simulated` (`make demo`): trimtab on the simulated heterogeneous fleet.

Starts the simulated fleet (``trimtab sim --fleet examples/fleet-hetero.yaml``: 2 x H100,
2 x A100, 2 x L4, vLLM + DCGM metrics), ``trimtab serve`` and a real Envoy that takes its
routes and weights from trimtab over ADS, then drives the mixed chat workload
(examples/workload-mixed.yaml) open-loop through Envoy for ``--duration`` measured seconds. A
live table shows, per endpoint: GPU class, trimtab's weight (its admin ``/v1/weights``), queue
(waiting requests) and KV-cache use (the simulator's ``/sim/stats``), ITL (the mean
inter-token gap of the requests that endpoint finished in the last 15 s, seen by the client)
and its share of the requests Envoy routed so far (per-host ``rq_total`` in ``/clusters``).
The trimtab run starts by printing the address of trimtab's live status page (its admin
``/``: ``>>> trimtab's live status page: http://127.0.0.1:PORT/``), which the live table
also shows under it while the run lasts.

Then the TTFT / E2E summary, and a comparison run: a fresh fleet behind Envoy's unweighted
``least_request``, fed the first ``--compare-duration`` seconds of the *same* schedule (same
seed and rate), compared with the same requests of the trimtab run. A request still running
``--tail`` seconds after the last arrival is cancelled and counted as ``unfinished`` (the
demo's time limit cut it off; it did not fail), and the comparison applies that same cut-off
to the trimtab run's requests. TTFT and E2E percentiles are over the requests that finished.

Every process is started and stopped by PID by :mod:`trimtab_dev.bench.runner` (also on
Ctrl-C or SIGTERM). On a terminal the table refreshes every second (rich); with ``--plain``
or when stdout is not a terminal, a compact table is printed every 10 s.
Exit status: 0 on success, 1 when something could not start, 2 on bad input, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trimtab_dev.bench import envoy_configs, report
from trimtab_dev.bench.cli import interrupts_as_keyboard, long_context_for
from trimtab_dev.bench.fleet import SimFleetProcess
from trimtab_dev.bench.processes import BenchError
from trimtab_dev.bench.runner import LoadPlan, LoadRun, measure
from trimtab_dev.bench.stack import PolicyStack
from trimtab_dev.demo.live import (
    LIVE_EVERY_S,
    Display,
    LiveDisplay,
    PlainDisplay,
    RunView,
    samplers,
    status_banner,
)
from trimtab_dev.envoy_process import EnvoyError
from trimtab_dev.loadgen.workload import Workload, WorkloadError, load_workload
from trimtab_dev.sim.fleet import FleetError, load_fleet

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FLEET = ROOT / "examples" / "fleet-hetero.yaml"
DEFAULT_WORKLOAD = ROOT / "examples" / "workload-mixed.yaml"
# workload-mixed's 17 req/s is 65% of fleet-hetero's capacity (26.2 req/s). On 2 shared cores
# 8 req/s (~30%) kept the simulator's loop lag p99 at 4-9 ms next to Envoy, trimtab and the
# client; 12 req/s already pushed it to ~50 ms (max 170 ms).
DEFAULT_RATE = 8.0
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130


@dataclass(frozen=True)
class DemoSettings:
    fleet: Path
    workload: Path
    rate: float
    duration: float
    compare_duration: float
    warmup: float
    tail: float
    seed: int
    interval: float
    compare: bool
    plain: bool
    long_context_tokens: int = 0

    def plan(self, duration: float) -> LoadPlan:
        return LoadPlan(self.rate, self.warmup, duration, self.seed, self.tail)


# ---- one run ---------------------------------------------------------------------------------
async def _refresh(view: RunView, display: Display) -> None:
    while True:
        await asyncio.sleep(LIVE_EVERY_S)
        display.show(view)


async def _measure(stack: PolicyStack, view: RunView, w: Workload, display: Display) -> LoadRun:
    display.start()
    ticker = asyncio.create_task(_refresh(view, display))
    try:
        return await measure(stack.listener_url, w, view.plan, list(view.samplers.values()),
                             view.counters, view.on_record)
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        display.show(view, final=True)
        display.stop()


def run_policy(policy: str, s: DemoSettings, w: Workload, model: str, duration: float,
               workdir: Path, display: Display) -> LoadRun:
    """A fresh fleet, Envoy (and trimtab for ``trimtab``) and the load; all stopped by PID."""
    workdir.mkdir(parents=True, exist_ok=True)
    sim = SimFleetProcess(s.fleet, model, workdir)
    try:
        fleet = sim.start()
        stack = PolicyStack(policy, fleet, workdir, interval=s.interval,
                            long_context=long_context_for(fleet, w, s.long_context_tokens))
        try:
            stack.start()
            pids = [f"sim {sim.child.pid}", f"envoy {stack.envoy.pid}"]
            if stack.trimtab is not None:
                pids.append(f"trimtab {stack.trimtab.pid}")
            display.say(f"{policy}: pids {', '.join(pids)}; Envoy routes to "
                        f"{len(fleet.servers)} endpoints at {stack.listener_url}; "
                        f"{s.warmup:g} s warm-up + {duration:g} s measured")
            status = None if stack.trimtab_admin_url is None else f"{stack.trimtab_admin_url}/"
            if status is not None:
                display.say(status_banner(status))
            view = RunView(policy, fleet, s.plan(duration), samplers(stack, s.interval),
                           status_url=status)
            return asyncio.run(_measure(stack, view, w, display))
        finally:
            stack.close()
    finally:
        sim.stop()
        display.say(f"{policy}: stopped every process of this run")


# ---- the summary -------------------------------------------------------------------------------
def window(run: LoadRun, plan: LoadPlan) -> LoadRun:
    """``run`` as if it had been ``plan``: the requests scheduled before ``plan``'s end (the
    same seed and rate give the same first requests), and those that had not finished
    ``plan.tail_s`` after it marked ``unfinished``, as the shorter run would have."""
    cutoff = plan.total + plan.tail_s
    records = []
    for r in run.records:
        if r.scheduled_at >= plan.total:
            continue
        late = r.error is None and r.e2e is not None and r.sent_at + r.e2e > cutoff
        records.append(replace(r, error="unfinished", e2e=cutoff - r.sent_at) if late else r)
    return replace(run, records=records)


def figures(run: LoadRun, plan: LoadPlan, policy: str) -> dict[str, Any]:
    summary = report.policy_summary(run, plan, f"envoy:{policy}")
    return {**report.metrics(summary), "requests": summary["requests"]["sent"],
            "unfinished": summary["unfinished"]}


def summary_line(policy: str, f: dict[str, Any], seconds: float) -> str:
    return (f"{policy:<14} {seconds:g} s  {f['requests']} requests  TTFT p50 "
            f"{report.fmt_s(f['ttft_p50'])}  TTFT p99 {report.fmt_s(f['ttft_p99'])}  E2E p99 "
            f"{report.fmt_s(f['e2e_p99'])}  failed {f['errors'] - f['unfinished']}  unfinished "
            f"{f['unfinished']}")


def health_line(run: LoadRun, plan: LoadPlan) -> str:
    """The simulator's loop lag over its last 60 s (its last sample: the end of the run, not
    its start-up) and CPU over the measured window, and the client's own loop lag."""
    samples = run.samples.get("sim", [])
    last = samples[-1][1] if samples else {}
    cpu = report.sim_summary(samples, plan.warmup).get("cpu_percent", 0.0)
    return (f"  measurement health: sim loop lag p99 {last.get('loop_lag_p99_ms', 0.0):.1f} ms "
            f"(max {last.get('loop_lag_max_ms', 0.0):.0f} ms) over its last 60 s, sim CPU "
            f"{cpu:.0f}%, client loop lag p99 {run.client['loop_lag_p99_ms']:.1f} ms")


def ratio_of(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def comparison_lines(main: LoadRun, base: LoadRun, s: DemoSettings) -> list[str]:
    plan = s.plan(s.compare_duration)
    ours, theirs = figures(window(main, plan), plan, "trimtab"), figures(base, plan, "lr")
    ratio = {k: report.fmt_x(ratio_of(ours[k], theirs[k]))
             for k in ("ttft_p50", "ttft_p99", "e2e_p99")}
    return [f"\ncomparison: the same first {s.compare_duration:g} s of the schedule "
            f"(seed {s.seed}, {s.rate:g} req/s) through each policy",
            summary_line("trimtab", ours, s.compare_duration),
            summary_line(envoy_configs.BASELINE, theirs, s.compare_duration),
            health_line(base, plan),
            f"ratio trimtab / {envoy_configs.BASELINE}: TTFT p50 {ratio['ttft_p50']}  "
            f"TTFT p99 {ratio['ttft_p99']}  E2E p99 {ratio['e2e_p99']}"]


def summary_lines(main: LoadRun, base: LoadRun | None, s: DemoSettings) -> list[str]:
    plan = s.plan(s.duration)
    lines = [f"\nsummary: trimtab, {s.duration:g} s measured after {s.warmup:g} s warm-up",
             summary_line("trimtab", figures(main, plan, "trimtab"), s.duration),
             health_line(main, plan)]
    if base is not None:
        lines += comparison_lines(main, base, s)
    return lines


# ---- command line ------------------------------------------------------------------------------
def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trimtab_dev.demo.simulated", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", type=Path, default=DEFAULT_FLEET, help="fleet YAML")
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD, help="workload YAML")
    p.add_argument("--rate", type=_positive, default=DEFAULT_RATE,
                   help=f"req/s (default {DEFAULT_RATE:g})")
    p.add_argument("--duration", type=_positive, default=60.0,
                   help="measured seconds of the trimtab run (default 60)")
    p.add_argument("--compare-duration", type=_positive, default=30.0,
                   help="measured seconds of the least_request run (default 30)")
    p.add_argument("--no-compare", action="store_true", help="skip the least_request run")
    p.add_argument("--warmup", type=_non_negative, default=5.0,
                   help="unmeasured seconds before each run (default 5)")
    p.add_argument("--tail", type=_non_negative, default=20.0,
                   help="seconds after the last arrival before a request counts as "
                        "unfinished (default 20)")
    p.add_argument("--seed", type=int, help="schedule seed (default: the workload's)")
    p.add_argument("--interval", type=_positive, default=1.0,
                   help="trimtab's telemetry interval in seconds (default 1)")
    p.add_argument("--plain", action="store_true",
                   help="print a table every 10 s instead of the live one")
    p.add_argument("--long-context-tokens", type=int, default=8192, metavar="N",
                   help="trimtab routes prompts of >= N tokens (content-length >= 4*N) to a "
                        "long-context pool of the big-KV servers (see trimtab bench; "
                        "0: off; default 8192)")
    p.add_argument("--logs", type=Path, help="keep every process's log and config here")
    return p


def settings_from(args: argparse.Namespace, w: Workload) -> DemoSettings:
    compare_duration = min(args.compare_duration, args.duration)
    return DemoSettings(
        fleet=args.fleet, workload=args.workload, rate=args.rate, duration=args.duration,
        compare_duration=compare_duration, warmup=args.warmup, tail=args.tail,
        seed=w.seed if args.seed is None else args.seed, interval=args.interval,
        compare=not args.no_compare, plain=args.plain or not sys.stdout.isatty(),
        long_context_tokens=max(0, args.long_context_tokens) if w.realistic_bodies else 0)


def run_demo(s: DemoSettings, w: Workload, model: str, workdir: Path) -> list[str]:
    """Both runs; returns the summary lines."""
    display: Display = PlainDisplay() if s.plain else LiveDisplay()
    main_run = run_policy("trimtab", s, w, model, s.duration, workdir / "trimtab", display)
    base = None
    if s.compare:
        base = run_policy(envoy_configs.BASELINE, s, w, model, s.compare_duration,
                          workdir / envoy_configs.BASELINE, display)
    return summary_lines(main_run, base, s)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        w = load_workload(args.workload)
        model = load_fleet(args.fleet).model
        s = settings_from(args, w)
    except (WorkloadError, FleetError, OSError, ValueError) as exc:
        print(f"demo: invalid input: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    started = time.monotonic()
    try:
        with interrupts_as_keyboard(), tempfile.TemporaryDirectory(prefix="trimtab-demo-") as tmp:
            lines = run_demo(s, w, model, args.logs or Path(tmp))
    except (BenchError, EnvoyError, OSError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("demo: interrupted; every process it started was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print("\n".join([*lines, f"\ndemo finished in {time.monotonic() - started:.0f} s"]),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
