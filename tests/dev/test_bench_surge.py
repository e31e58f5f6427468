"""`trimtab bench`'s surge judge on hand-built records: goodput, good tokens/s, refusals,
served P99 TTFT, time to recover, the after-surge fraction and per-tenant goodput, worked
out by hand below; then the ratios and issue 23's targets, the tables and the settings."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from trimtab_dev.bench import report, spread, surge
from trimtab_dev.bench.runner import LoadPlan, LoadRun
from trimtab_dev.bench.surge import SurgeSpec
from trimtab_dev.loadgen.runner import RequestRecord
from trimtab_dev.loadgen.workload import load_workload

PLAN = LoadPlan(rate=1.0, warmup=5.0, duration=55.0, seed=1, tail_s=10.0)  # schedule 0-60 s
SPEC = SurgeSpec(start_s=20.0, end_s=30.0, factor=2.0, slo_s=3.0, tick_s=2.0,
                 tenants=("t0", "t1"), flood_tenant="t0")


def served(at: float, ttft: float, tenant: str = "t1", tokens: int = 100) -> RequestRecord:
    return RequestRecord(0, "chat", 100, tokens, scheduled_at=at, sent_at=at, status=200,
                         ttft=ttft, e2e=ttft + 1.0, output_tokens=tokens, tenant=tenant)


def refused(at: float, e2e: float, shaped: bool) -> RequestRecord:
    return RequestRecord(0, "chat", 100, 100, scheduled_at=at, sent_at=at, status=429,
                         e2e=e2e, refused=True, openai_error=True, tenant="t0",
                         retry_after="1" if shaped else None,
                         retry_after_s=1.0 if shaped else None)


def records() -> list[RequestRecord]:
    """Warm-up: 1 request (not measured). Before the surge, 5..19 s: 15 good (TTFT 0.5 s).
    The surge, 20..29.5 s every 0.5 s (tenant t0): 10 refused (answers in 10..100 ms, 8
    OpenAI-shaped with Retry-After), 9 served late (TTFT 10 s), 1 unfinished. After it,
    30..59 s every second: TTFT 5 s until 37 s, then 1 s."""
    out = [served(2.0, 0.1)]
    out += [served(float(t), 0.5) for t in range(5, 20)]
    surge_at = [20.0 + 0.5 * k for k in range(20)]
    out += [refused(at, 0.01 * (k + 1), shaped=k < 8) for k, at in enumerate(surge_at[:10])]
    out += [served(at, 10.0, tenant="t0") for at in surge_at[10:19]]
    out.append(replace(served(surge_at[19], 10.0, tenant="t0"), error="unfinished", ttft=None))
    out += [served(float(t), 5.0 if t < 38 else 1.0) for t in range(30, 60)]
    return out


def test_goodput_and_good_tokens() -> None:
    m = surge.judge(records(), PLAN, SPEC)
    assert m["requests"] == 15 + 20 + 30  # the warm-up request is not measured
    assert m["good"] == 15 + 22  # before the surge, and 38..59 s after it
    assert m["goodput"] == pytest.approx(37 / 65)
    assert m["good_tokens_per_s"] == pytest.approx(37 * 100 / 55)
    assert m["served"] == 15 + 9 + 30 and m["errors"] == 1


def test_refusals_count_latency_and_shape() -> None:
    m = surge.judge(records(), PLAN, SPEC)
    assert m["refused"] == 10
    assert m["refusal_p50"] == pytest.approx(0.055)  # between 50 and 60 ms
    assert m["refusal_p99"] == pytest.approx(0.09 + 0.01 * 0.91)  # 0.99 x 9 = 8.91
    assert m["refusals_openai_retry_after"] == 8
    assert m["refusals_openai_retry_after_fraction"] == pytest.approx(0.8)


def test_served_p99_ttft_is_over_the_requests_served_whole() -> None:
    # 54 served: 15 x 0.5, 22 x 1, 8 x 5, 9 x 10; positions 52 and 53 are both 10 s
    assert surge.judge(records(), PLAN, SPEC)["served_ttft_p99"] == pytest.approx(10.0)


def test_time_to_recover_and_the_after_surge_fraction() -> None:
    m = surge.judge(records(), PLAN, SPEC)
    # The window [37.5, 42.5) holds 38..42 s, all good; [37, 42) still holds 37 s (4/5).
    assert m["recovery_s"] == pytest.approx(7.5)
    # arrivals >= 30 + 2 ticks = 34 s: 26, of which 38..59 s (22) within the SLO
    assert m["after_surge_requests"] == 26
    assert m["after_surge_within_slo"] == pytest.approx(22 / 26)


def test_no_recovery_inside_the_schedule_is_none() -> None:
    late = [replace(r, ttft=5.0) if r.scheduled_at >= 30 else r for r in records()]
    assert surge.judge(late, PLAN, SPEC)["recovery_s"] is None
    stricter = replace(SPEC, recovery_fraction=1.0, recovery_window_s=30.0)
    assert surge.recovery_s(records(), stricter, 60.0) is None  # [30, 60) holds bad ones


def test_per_tenant_goodput_and_the_others_of_a_flood() -> None:
    tenants = surge.judge(records(), PLAN, SPEC)["per_tenant"]
    assert tenants["t0"] == {"requests": 20, "good": 0, "refused": 10, "goodput": 0.0}
    assert tenants["t1"]["goodput"] == pytest.approx(37 / 45)
    assert tenants["others"] == tenants["t1"]
    calm = surge.judge(records(), PLAN, replace(SPEC, flood_tenant=None))["per_tenant"]
    assert set(calm) == {"t0", "t1"}


def _flat(good_tokens: float, **over: Any) -> dict[str, Any]:
    base = {"goodput": 0.5, "good_tokens_per_s": good_tokens, "served_ttft_p99": 5.0,
            "refusal_p99": None, "refusals_openai_retry_after_fraction": None,
            "after_surge_within_slo": 0.5, "errors": 0}
    return {"surge": {**base, **over}}


def test_targets_and_ratios_against_least_request_and_reference() -> None:
    entries = {"least_request": _flat(1000.0), "reference": _flat(800.0),
               "trimtab": _flat(1400.0, served_ttft_p99=5.9, refusal_p99=0.02,
                                refusals_openai_retry_after_fraction=1.0,
                                after_surge_within_slo=0.97)}
    cmp: dict[str, Any] = {"ratios": {}, "targets": []}
    surge.extend_comparison(cmp, entries, SPEC)
    assert cmp["target_set"] == "surge"
    assert cmp["ratios"]["trimtab"]["good_tokens_per_s_vs_least_request"] == pytest.approx(1.4)
    assert cmp["ratios"]["trimtab"]["good_tokens_per_s_vs_reference"] == pytest.approx(1.75)
    verdicts = {t["name"]: t["met"] for t in cmp["targets"]}
    assert verdicts == {"good_tokens_vs_least_request": True, "good_tokens_vs_reference": True,
                        "served_ttft_p99_vs_slo": True, "refusal_p99": True,
                        "refusals_openai_retry_after": True, "after_surge_within_slo": True,
                        "no_failures": True}
    worse = {**entries, "trimtab": _flat(1200.0, served_ttft_p99=6.1, errors=2)}
    surge.extend_comparison(cmp, worse, SPEC)
    verdicts = {t["name"]: t["met"] for t in cmp["targets"]}
    assert verdicts["good_tokens_vs_least_request"] is False  # 1.2 < 1.3
    assert verdicts["served_ttft_p99_vs_slo"] is False  # 6.1 s > 2 x 3 s
    assert verdicts["refusal_p99"] is None  # nothing refused: nothing to judge
    assert verdicts["refusals_openai_retry_after"] is None
    assert verdicts["after_surge_within_slo"] is False and verdicts["no_failures"] is False
    alone = {"least_request": _flat(1000.0), "trimtab": _flat(1400.0)}
    surge.extend_comparison(cmp, alone, SPEC)
    assert {t["name"]: t["met"] for t in cmp["targets"]}["good_tokens_vs_reference"] is None


def _doc(tmp_path: Path) -> dict[str, Any]:
    """A bench.json as run_all builds it, with two policies on the same records."""
    runs = {"least_request": records(), "trimtab": records()}
    client = {"loop_lag_p99_ms": 1.0, "cpu_seconds": 1.0}
    entries = {p: {"summary": report.policy_summary(LoadRun(r, 60.0, client, 0, 0.0), PLAN,
                                                    "x"),
                   "client": client, "sim": {}, "drain_before_s": 0.0}
               for p, r in runs.items()}
    config = {"fleet": "f.yaml", "workload": "w.yaml", "rate": 1.0, "duration": 55.0,
              "warmup": 5.0, "surge": SPEC.to_dict()}
    doc = {"config": config, "seed": 1, "policies": entries,
           "comparison": report.comparison(entries)}
    surge.add_surge(doc, runs, PLAN)
    return doc


def test_the_bench_document_and_its_tables(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = _doc(tmp_path)
    assert doc["policies"]["trimtab"]["surge"]["refused"] == 10
    assert doc["policies"]["trimtab"]["summary"]["requests"]["refused"] == 10
    assert doc["comparison"]["target_set"] == "surge"
    report.print_report(doc)
    text = capsys.readouterr().out
    assert "surge: x2 from 20 s to 30 s" in text and "7.5 s" in text and "8/10" in text
    assert "t0 goodput" in text and "others goodput" in text
    assert "targets (surge, issue 23's)" in text
    many = spread.spread({1: doc, 2: doc})
    assert many["surge"]["trimtab"]["recovery_s"]["median"] == pytest.approx(7.5)
    assert many["ratios"]["trimtab"]["good_tokens_per_s_vs_least_request"]["median"] == 1.0


def test_no_surge_in_the_config_leaves_the_document_alone() -> None:
    doc: dict[str, Any] = {"config": {}, "policies": {"trimtab": {}},
                           "comparison": {"target_set": "heterogeneous"}}
    surge.add_surge(doc, {"trimtab": records()}, PLAN)
    assert doc["comparison"] == {"target_set": "heterogeneous"} and doc["policies"]["trimtab"] == {}


def test_the_example_workloads_and_the_bench_settings(tmp_path: Path) -> None:
    from trimtab_dev.bench.options import build_parser, settings_from

    w = load_workload("examples/workload-surge.yaml")
    spec = surge.spec_of(w, 2.0)
    assert spec is not None and (spec.start_s, spec.end_s, spec.slo_s) == (60.0, 75.0, 3.0)
    assert spec.tenants == ("t0", "t1", "t2", "t3") and spec.flood_tenant is None
    flood = surge.spec_of(load_workload("examples/workload-surge-flood.yaml"), 2.0)
    assert flood is not None and flood.flood_tenant == "t0"
    assert surge.spec_of(load_workload("examples/workload-mixed.yaml"), 2.0) is None

    def settings(workload: Any, *extra: str) -> Any:
        return settings_from(build_parser().parse_args(["--out", str(tmp_path), *extra]),
                             workload)

    assert settings(w).surge["end_s"] == 75.0  # --duration 120: warm-up 12 s, ends at 132 s
    with pytest.raises(ValueError, match="surge-start"):
        settings(w, "--duration", "40")  # the surge at 60 s starts after the run
    early = surge.with_start(w, 15.0)
    assert settings(early, "--duration", "40").surge["start_s"] == 15.0
    assert settings(load_workload("examples/workload-mixed.yaml")).surge is None
    with pytest.raises(ValueError):
        surge.with_start(load_workload("examples/workload-mixed.yaml"), 15.0)
