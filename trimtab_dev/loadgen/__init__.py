"""Open-loop load generator for OpenAI-compatible LLM servers, with a JSON report."""

from trimtab_dev.loadgen.report import summarize, sweep_report
from trimtab_dev.loadgen.runner import RequestRecord, RunResult, SseParser, run_load
from trimtab_dev.loadgen.workload import (
    PlannedRequest,
    Workload,
    build_schedule,
    load_workload,
    parse_workload,
)

__all__ = [
    "PlannedRequest", "RequestRecord", "RunResult", "SseParser", "Workload", "build_schedule",
    "load_workload", "parse_workload", "run_load", "summarize", "sweep_report",
]
