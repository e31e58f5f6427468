"""The surge scenario's judge (issue 23): what each policy served of a surge within the SLO,
what it refused and how, and how fast it recovered.

Over the requests scheduled after the warm-up (every one counts, refused and failed
included):

* **goodput**: the fraction served whole (no error, not refused) with TTFT <= the SLO;
  **good output tokens/s**: those requests' output tokens over the measured duration;
* **refusals** (HTTP 429): count, answer latency p50/p99, and how many were OpenAI-shaped
  with a readable ``Retry-After``;
* **served P99 TTFT**: over the requests served whole;
* **time to recover**: from the surge's end to the start of the first rolling window of
  arrivals (``recovery_window_s`` long, starts every ``RECOVERY_STEP_S``, inside the
  schedule) in which at least ``recovery_fraction`` met the SLO; None when none did;
* **after the surge**: the fraction within the SLO of the requests arriving two ticks or
  more after the surge's end;
* **per tenant**: goodput per tenant, and of the tenants other than a flooding one.

Ratios against ``least_request`` and ``reference`` and issue 23's targets are added to the
bench's comparison (``target_set: surge``); the tables are in :mod:`.surge_tables`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trimtab_dev.bench.envoy_configs import BASELINE, REFERENCE
from trimtab_dev.bench.runner import LoadPlan
from trimtab_dev.loadgen.report import percentile
from trimtab_dev.loadgen.runner import RequestRecord
from trimtab_dev.loadgen.workload import Workload, surge_window

DEFAULT_SLO_S = 3.0  # issue 23's TTFT SLO when the workload names none
RECOVERY_WINDOW_S = 5.0
RECOVERY_STEP_S = 0.5
RECOVERY_FRACTION = 0.95
AFTER_TICKS = 2  # "requests arriving >= 2 ticks after the surge ends"
RATIO_KEYS = ("goodput", "good_tokens_per_s", "served_ttft_p99")


@dataclass(frozen=True)
class SurgeSpec:
    """What the judge needs: the surge (schedule seconds), the SLO, the tick, the tenants."""

    start_s: float
    end_s: float
    factor: float
    slo_s: float
    tick_s: float
    tenants: tuple[str, ...] = ()
    flood_tenant: str | None = None
    recovery_window_s: float = RECOVERY_WINDOW_S
    recovery_fraction: float = RECOVERY_FRACTION

    @property
    def after_s(self) -> float:
        """Arrivals from here on count as "after the surge"."""
        return self.end_s + AFTER_TICKS * self.tick_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tenants": list(self.tenants)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> SurgeSpec:
        return cls(**{**doc, "tenants": tuple(doc.get("tenants", ()))})


def spec_of(w: Workload, tick_s: float) -> SurgeSpec | None:
    """The workload's surge, or None when its arrivals are not a surge."""
    window = surge_window(w.arrival)
    if window is None:
        return None
    tenants = w.tenants
    flood = tenants.flood if tenants else None
    return SurgeSpec(start_s=window[0], end_s=window[1], factor=w.arrival.factor,
                     slo_s=w.ttft_slo_s or DEFAULT_SLO_S, tick_s=tick_s,
                     tenants=tuple(tenants.names) if tenants else (),
                     flood_tenant=flood.tenant if flood else None)


def with_start(w: Workload, start_s: float) -> Workload:
    """``w`` with its surge starting at ``start_s``; ValueError when it has no surge."""
    if w.arrival.kind != "surge":
        raise ValueError("--surge-start needs a workload with arrival kind: surge")
    if start_s < 0:
        raise ValueError("--surge-start must be >= 0")
    return w.model_copy(update={"arrival": w.arrival.model_copy(update={"start_s": start_s})})


# ---- the judge ----------------------------------------------------------------------------
def good(r: RequestRecord, slo_s: float) -> bool:
    """Served whole with TTFT within the SLO."""
    return r.served and r.ttft is not None and r.ttft <= slo_s


def _fraction(records: Sequence[RequestRecord], slo_s: float) -> float | None:
    return sum(good(r, slo_s) for r in records) / len(records) if records else None


def _quantile(values: Sequence[float], q: float) -> float | None:
    return percentile(sorted(values), q) if values else None


def recovery_s(records: Sequence[RequestRecord], spec: SurgeSpec, end: float) -> float | None:
    """Seconds from the surge's end to the first window of arrivals that meets the SLO at
    ``recovery_fraction`` (see the module docstring); None when no window inside
    ``[surge end, end]`` does."""
    times = sorted((r.scheduled_at, good(r, spec.slo_s)) for r in records)
    steps = 0
    while (t := spec.end_s + steps * RECOVERY_STEP_S) + spec.recovery_window_s <= end + 1e-9:
        window = [ok for at, ok in times if t <= at < t + spec.recovery_window_s]
        if window and sum(window) / len(window) >= spec.recovery_fraction:
            return t - spec.end_s
        steps += 1
    return None


def tenant_goodput(records: Sequence[RequestRecord], spec: SurgeSpec) -> dict[str, Any]:
    """Per tenant: requests, good, refused and goodput; ``others`` (every tenant but the
    flooding one) when there is a flood."""
    out: dict[str, Any] = {}
    groups = {t: [r for r in records if r.tenant == t] for t in spec.tenants}
    if spec.flood_tenant is not None:
        groups["others"] = [r for r in records
                            if r.tenant is not None and r.tenant != spec.flood_tenant]
    for name, group in groups.items():
        out[name] = {"requests": len(group), "good": sum(good(r, spec.slo_s) for r in group),
                     "refused": sum(r.refused for r in group),
                     "goodput": _fraction(group, spec.slo_s)}
    return out


def judge(records: Sequence[RequestRecord], plan: LoadPlan, spec: SurgeSpec) -> dict[str, Any]:
    """One policy's surge figures over the requests scheduled after the warm-up."""
    measured = [r for r in records if r.scheduled_at >= plan.warmup]
    wins = [r for r in measured if good(r, spec.slo_s)]
    refused = [r for r in measured if r.refused]
    shaped = [r for r in refused if r.openai_error and r.retry_after_s is not None]
    served_ttft = [r.ttft for r in measured if r.served and r.ttft is not None]
    after = [r for r in measured if r.scheduled_at >= spec.after_s]
    return {
        "requests": len(measured),
        "good": len(wins),
        "goodput": _fraction(measured, spec.slo_s),
        "good_tokens_per_s": sum(r.output_tokens for r in wins) / max(plan.duration, 1e-9),
        "served": sum(r.served for r in measured),
        "served_ttft_p99": _quantile(served_ttft, 0.99),
        "refused": len(refused),
        "refusal_p50": _quantile([r.e2e for r in refused if r.e2e is not None], 0.50),
        "refusal_p99": _quantile([r.e2e for r in refused if r.e2e is not None], 0.99),
        "refusals_openai_retry_after": len(shaped),
        "refusals_openai_retry_after_fraction": len(shaped) / len(refused) if refused else None,
        "errors": sum(r.error is not None for r in measured),
        "recovery_s": recovery_s(measured, spec, plan.total),
        "after_surge_requests": len(after),
        "after_surge_within_slo": _fraction(after, spec.slo_s),
        "per_tenant": tenant_goodput(measured, spec),
    }


# ---- the comparison -----------------------------------------------------------------------
# (name, description, metric, operator, limit, compared with: a policy, "slo", or None)
SurgeTarget = tuple[str, str, str, str, float, str | None]
TARGETS: tuple[SurgeTarget, ...] = (
    ("good_tokens_vs_least_request", "trimtab good output tok/s / least_request",
     "good_tokens_per_s", ">=", 1.3, BASELINE),
    ("good_tokens_vs_reference", "trimtab good output tok/s / reference",
     "good_tokens_per_s", ">=", 1.3, REFERENCE),
    ("served_ttft_p99_vs_slo", "trimtab served P99 TTFT / the SLO", "served_ttft_p99", "<=",
     2.0, "slo"),
    ("refusal_p99", "trimtab refusals answered, p99 (s)", "refusal_p99", "<=", 0.050, None),
    ("refusals_openai_retry_after", "trimtab refusals OpenAI-shaped with Retry-After (of all)",
     "refusals_openai_retry_after_fraction", ">=", 1.0, None),
    ("after_surge_within_slo", "trimtab arrivals >= 2 ticks after the surge within the SLO",
     "after_surge_within_slo", ">=", 0.95, None),
    ("no_failures", "trimtab errors (failed, not refused)", "errors", "==", 0, None),
)
_OPS = {"<=": lambda v, lim: v <= lim, ">=": lambda v, lim: v >= lim,
        "==": lambda v, lim: v == lim}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _value(flat: Mapping[str, Mapping[str, Any]], metric: str, other: str | None,
           slo_s: float) -> float | None:
    mine = flat["trimtab"][metric]
    if other is None:
        return mine
    if other == "slo":
        return _ratio(mine, slo_s)
    return _ratio(mine, flat[other][metric]) if other in flat else None


def targets(flat: Mapping[str, Mapping[str, Any]], spec: SurgeSpec) -> list[dict[str, Any]]:
    """Issue 23's targets for trimtab; ``met`` None when it cannot be judged (a policy not
    run, no refusals to judge the refusals by, trimtab not run)."""
    if "trimtab" not in flat:
        return []
    out = []
    for name, text, metric, op, limit, other in TARGETS:
        value = _value(flat, metric, other, spec.slo_s)
        out.append({"name": name, "what": text, "value": value, "op": op, "limit": limit,
                    "met": None if value is None else _OPS[op](value, limit)})
    return out


def extend_comparison(cmp: dict[str, Any], entries: Mapping[str, Mapping[str, Any]],
                      spec: SurgeSpec) -> None:
    """Add the surge figures, their ratios and issue 23's targets to ``cmp`` (the bench's
    comparison), in place; ``targets`` becomes the surge's."""
    flat = {p: e["surge"] for p, e in entries.items()}
    bases = [BASELINE] + [REFERENCE] * (REFERENCE in flat)
    for policy, m in flat.items():
        row = cmp["ratios"].setdefault(policy, {})
        for base in bases:
            for key in RATIO_KEYS:
                row[f"{key}_vs_{base}"] = (_ratio(m[key], flat[base][key])
                                           if base in flat else None)
    cmp["surge"] = {"spec": spec.to_dict(), "metrics": flat}
    cmp["target_set"] = "surge"
    cmp["targets"] = targets(flat, spec)


def add_surge(doc: dict[str, Any], records: Mapping[str, Sequence[RequestRecord]],
              plan: LoadPlan) -> None:
    """Judge every policy's records when ``doc``'s config has a surge; nothing otherwise."""
    raw = doc["config"].get("surge")
    if not raw:
        return
    spec = SurgeSpec.from_dict(raw)
    for policy, recs in records.items():
        doc["policies"][policy]["surge"] = judge(recs, plan, spec)
    extend_comparison(doc["comparison"], doc["policies"], spec)


def check_plan(spec: SurgeSpec | None, plan: LoadPlan) -> None:
    """ValueError when the surge does not start inside the measured schedule."""
    if spec is not None and not plan.warmup <= spec.start_s < plan.total:
        raise ValueError(f"the surge starts at {spec.start_s:g} s, outside the measured "
                         f"schedule [{plan.warmup:g}, {plan.total:g}) s: see --surge-start")

