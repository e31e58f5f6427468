"""`trimtab bench`'s options: the command line, checked, into :class:`BenchSettings`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from trimtab_dev.bench import envoy_configs, report, surge
from trimtab_dev.bench.runner import (
    LoadPlan,
)
from trimtab_dev.loadgen.workload import Workload
from trimtab_dev.sim.fleet import FleetSpec, expand

LONG_POOL_KV_FACTOR = 8.0  # the default --long-context-kv-factor


@dataclass(frozen=True)
class BenchSettings:
    fleet: str
    workload: str
    policies: tuple[str, ...]
    duration: float
    warmup: float
    tail: float
    rate: float
    seed: int
    weights: str
    interval: float
    out: str
    composite: dict[str, Any] = field(default_factory=dict)
    long_context_tokens: int = 0
    long_context_kv_factor: float = LONG_POOL_KV_FACTOR
    homogeneous: bool = False  # which targets: see fleet_is_homogeneous and --targets
    tolerance: float = report.HOMOGENEOUS_TOLERANCE
    lb_policy: str = "least_request"
    queueing: dict[str, Any] = field(default_factory=dict)
    auto_classes: bool = False
    active_request_bias: float | None = None
    surge: dict[str, Any] | None = None  # surge.SurgeSpec.to_dict() for a surge workload

    def plan(self) -> LoadPlan:
        return LoadPlan(self.rate, self.warmup, self.duration, self.seed, self.tail)


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in envoy_configs.POLICIES]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"a comma-separated subset of {','.join(envoy_configs.POLICIES)}, no repeats")
    return names


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError("comma-separated integers, e.g. 42,1,2") from exc
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError("comma-separated integers, no repeats")
    return seeds


def _tolerance(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _overrides(text: str) -> dict[str, Any]:
    """``key=value,...`` for ``weights.composite``; numbers become floats."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trimtab bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", help="fleet YAML (trimtab sim); required unless --report-only")
    p.add_argument("--workload", help="workload YAML (trimtab load); required unless "
                                      "--report-only")
    p.add_argument("--policies", type=_policies, default=envoy_configs.POLICIES,
                   help="comma-separated, run in this order (default: all five; "
                        "reference = capacity x (1 - KV use) every 2 s, see "
                        "docs/simulator.md)")
    p.add_argument("--duration", type=_positive, default=120.0,
                   help="measured seconds per policy (default 120)")
    p.add_argument("--warmup", type=float,
                   help="unmeasured seconds before (default: 10%% of --duration, at least 5)")
    p.add_argument("--tail", type=float, default=60.0,
                   help="seconds a request may still run after the last arrival before it "
                        "counts as unfinished (default 60)")
    p.add_argument("--rate", type=_positive, help="req/s (default: the workload's)")
    p.add_argument("--seed", type=int, help="schedule seed (default: the workload's)")
    p.add_argument("--seeds", type=_seeds, metavar="S1,S2,...",
                   help="run the whole comparison once per seed, into --out/seed-<S>, and "
                        "print/write the spread of every ratio (--out/spread.json)")
    p.add_argument("--targets", choices=["auto", "heterogeneous", "homogeneous"],
                   default="auto",
                   help="which targets to judge trimtab by: the issue's (heterogeneous) or "
                        "'no worse than least_request within --tolerance' (homogeneous); "
                        "auto: homogeneous when every live server of the fleet is the same "
                        "(GPU, limits, faults)")
    p.add_argument("--tolerance", type=_tolerance, default=report.HOMOGENEOUS_TOLERANCE,
                   help="the homogeneous targets' tolerance: P99 TTFT ratio <= 1 + T, "
                        f"tokens/s ratio >= 1 - T (default {report.HOMOGENEOUS_TOLERANCE:g})")
    p.add_argument("--weights", choices=["queueing", "composite", "gpu_memory"],
                   default="queueing", help="trimtab's weight policy (default queueing, "
                                            "trimtab's default)")
    p.add_argument("--lb-policy", choices=["least_request", "round_robin"],
                   default="least_request",
                   help="trimtab's lb_policy (default least_request, trimtab's default; the "
                        "reference always runs least_request)")
    p.add_argument("--active-request-bias", type=float, metavar="B",
                   help="trimtab with --lb-policy least_request: Envoy's active_request_bias "
                        "(weight / (active + 1) ** B; Envoy's default 1)")
    p.add_argument("--queueing", type=_overrides, default={},
                   help="override trimtab's queueing knobs, e.g. deadband=0.2")
    p.add_argument("--interval", type=_positive, default=2.0,
                   help="trimtab's telemetry interval in seconds (default 2)")
    p.add_argument("--composite", type=_overrides, default={},
                   help="override trimtab's composite knobs, e.g. queue_cap=8,ewma_alpha=1")
    p.add_argument("--long-context-tokens", type=int, default=0, metavar="N",
                   help="trimtab only: route prompts of >= N tokens (content-length >= 4*N "
                        "bytes) to a long-context pool of the servers whose KV cache holds "
                        "--long-context-kv-factor of the workload's longest requests; needs "
                        "realistic_bodies in the workload (default 0: off)")
    p.add_argument("--long-context-kv-factor", type=_positive, default=LONG_POOL_KV_FACTOR,
                   metavar="F", help="how many of the workload's longest requests a server's "
                                     f"KV cache must hold to join the long-context pool "
                                     f"(default {LONG_POOL_KV_FACTOR:g})")
    p.add_argument("--auto-classes", action="store_true",
                   help="trimtab only: long_context: auto (prompt-size classes derived from "
                        "the servers' KV capacities); excludes --long-context-tokens")
    p.add_argument("--surge-start", type=float, metavar="S",
                   help="a surge workload: start the surge S seconds after the schedule's "
                        "first instant (the warm-up included) instead of its start_s")
    p.add_argument("--ttft-slo", type=float, metavar="S",
                   help="the workload's TTFT SLO (ttft_slo_s): trimtab runs with it as "
                        "slo.ttft_seconds (admission on); e.g. to check that steady load is "
                        "never refused")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild bench.json/png and the table from --out's records; run nothing")
    return p


def fleet_is_homogeneous(spec: FleetSpec) -> bool:
    """True when every live server is the same: GPU (with its limits), ``max_model_len``,
    efficiency and faults (a ``slow`` server makes a fleet heterogeneous)."""
    live = [c for c in expand(spec) if not c.faults.dead]
    return len({(c.gpu, c.max_model_len, c.efficiency, c.faults) for c in live}) == 1


def settings_from(args: argparse.Namespace, w: Workload,
                  fleet: FleetSpec | None = None) -> BenchSettings:
    warmup = args.warmup if args.warmup is not None else max(5.0, 0.1 * args.duration)
    if warmup < 0 or args.tail < 0:
        raise ValueError("--warmup and --tail must be >= 0")
    if args.long_context_tokens < 0:
        raise ValueError("--long-context-tokens must be >= 0")
    if args.auto_classes and args.long_context_tokens:
        raise ValueError("--auto-classes and --long-context-tokens exclude each other")
    if (args.long_context_tokens or args.auto_classes) and not w.realistic_bodies:
        raise ValueError("--long-context-tokens routes on content-length: the workload needs "
                         "realistic_bodies: true")
    spec = surge.spec_of(w, args.interval)
    settings = BenchSettings(
        fleet=args.fleet, workload=args.workload, policies=tuple(args.policies),
        duration=args.duration, warmup=warmup, tail=args.tail, rate=args.rate or w.rate,
        seed=w.seed if args.seed is None else args.seed, weights=args.weights,
        interval=args.interval, out=args.out, composite=dict(args.composite),
        long_context_tokens=args.long_context_tokens,
        long_context_kv_factor=args.long_context_kv_factor,
        lb_policy=args.lb_policy, queueing=dict(args.queueing),
        auto_classes=args.auto_classes, active_request_bias=args.active_request_bias,
        homogeneous=(args.targets == "homogeneous" if args.targets != "auto"
                     else fleet is not None and fleet_is_homogeneous(fleet)),
        tolerance=args.tolerance, surge=spec.to_dict() if spec else None)
    surge.check_plan(spec, settings.plan())
    return settings
