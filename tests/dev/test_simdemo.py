"""`python -m trimtab_dev.demo.simulated` (`make demo`): the matched-window arithmetic (fast) and a tiny
real run (slow: the simulated fleet, Envoy and trimtab) that must print the table and the
summaries and leave no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.paths import ROOT
from trimtab_dev.bench.runner import LoadPlan, LoadRun
from trimtab_dev.demo.live import envoy_host_requests, status_banner
from trimtab_dev.demo.simulated import window
from trimtab_dev.loadgen.runner import RequestRecord

ENDPOINTS = ("h100-0", "h100-1", "a100-0", "a100-1", "l4-0", "l4-1")  # fleet-hetero.yaml
# endpoint, GPU, weight (× its tier and the tier's weight), queue, KV use, ITL, expected share
# (not captured), the share Envoy sent (requests)
ROW = re.compile(r"^(\S+)\s+(\S+)\s+(\d+|-)(?: × \S+ \d+)?\s+(\d+|-)\s+(\d+%|-)\s+(.+?)"
                 r"\s+(?:\S+%|-)\s+(\S+%) \((\d+)\)$")
PIDS = re.compile(r"^(\S+): pids (.+?);")
STATUS = re.compile(r"^>>> trimtab's live status page: (http://127\.0\.0\.1:(\d+)/) ")


def _record(index: int, scheduled: float, e2e: float | None, error: str | None = None
            ) -> RequestRecord:
    return RequestRecord(index, "chat", 100, 10, scheduled_at=scheduled, sent_at=scheduled,
                         error=error, ttft=0.1, e2e=e2e, output_tokens=10, server="h100-0")


def test_window_keeps_the_prefix_and_cuts_off_as_the_shorter_run_would() -> None:
    run = LoadRun([_record(0, 1.0, 2.0), _record(1, 4.0, 30.0), _record(2, 6.0, 1.0),
                   _record(3, 4.5, None, "unfinished")], 40.0, {}, 1, 0.0)
    cut = window(run, LoadPlan(rate=1, warmup=0, duration=5, seed=1, tail_s=10))
    assert [r.index for r in cut.records] == [0, 1, 3]  # scheduled before 5 s
    assert [r.error for r in cut.records] == [None, "unfinished", "unfinished"]
    assert cut.records[1].e2e == pytest.approx(11.0)  # cut at 5 + 10 s, sent at 4 s
    assert run.records[1].error is None  # the original run is untouched


def test_envoy_host_requests_reads_rq_total_of_the_fleet_cluster() -> None:
    def host(port: int, total: int | None) -> dict[str, object]:
        stats = [{"name": "rq_total", **({"value": total} if total is not None else {})}]
        return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "stats": [{"name": "cx_total", "value": 9}, *stats]}

    doc = {"cluster_statuses": [{"name": "other", "host_statuses": [host(1, 5)]},
                                {"name": "fleet", "host_statuses": [host(2, 7), host(3, None)]}]}
    assert envoy_host_requests(doc) == {"127.0.0.1:2": 7, "127.0.0.1:3": 0}


def test_the_status_banner_names_the_address_on_a_line_of_its_own() -> None:
    lines = status_banner("http://127.0.0.1:40123/").splitlines()
    found = [m for m in map(STATUS.match, lines) if m]
    assert [m.group(1) for m in found] == ["http://127.0.0.1:40123/"]


def _group_members(pgid: int) -> list[str]:
    """Command lines of the live processes in process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid and stat[0] != "Z":
                out.append(Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " "))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] != "Z"


def _run_demo(timeout: float, logs: Path) -> tuple[subprocess.CompletedProcess[str], float, int]:
    cmd = [sys.executable, "-m", "trimtab_dev.demo.simulated", "--plain", "--duration", "8",
           "--compare-duration", "5", "--rate", "2", "--warmup", "2", "--tail", "6",
           "--logs", str(logs)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: the demo and its children only
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    return done, time.monotonic() - started, proc.pid


def _last_table(lines: list[str], policy: str) -> dict[str, re.Match[str]]:
    """The rows of the last table printed for ``policy``."""
    start = max(i for i, line in enumerate(lines) if line.startswith(f"final: {policy}"))
    rows = (ROW.match(line) for line in lines[start + 1:start + 3 + len(ENDPOINTS)])
    return {m.group(1): m for m in rows if m is not None}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tiny_demo_shows_weights_summaries_and_leaves_nothing_behind(tmp_path: Path) -> None:
    done, wall, pgid = _run_demo(timeout=90, logs=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert wall < 60, f"the tiny demo took {wall:.0f} s"
    lines = done.stdout.splitlines()
    trimtab = _last_table(lines, "trimtab weights")
    assert sorted(trimtab) == sorted(ENDPOINTS)
    assert all(m.group(3).isdigit() and int(m.group(3)) > 0 for m in trimtab.values()), trimtab
    assert sum(int(m.group(8)) for m in trimtab.values()) > 0  # Envoy routed requests
    assert sorted(_last_table(lines, "least_request (unweighted)")) == sorted(ENDPOINTS)
    summary = [line for line in lines if re.match(r"^(trimtab|least_request) +\d+ s +\d+ requests"
                                                  r" +TTFT p50 \S+ \S+ +TTFT p99", line)]
    assert [line.split()[0] for line in summary] == ["trimtab", "trimtab", "least_request"]
    assert any(line.startswith("ratio trimtab / least_request: TTFT p50") for line in lines)
    status = [(i, m) for i, m in enumerate(map(STATUS.match, lines)) if m]
    assert len(status) == 1, "the status page's address is printed once, for the trimtab run"
    assert status[0][0] < lines.index(next(x for x in lines if x.startswith("final: trimtab")))
    trimtab_config = yaml.safe_load((tmp_path / "trimtab" / "trimtab.yaml").read_text())
    assert trimtab_config["admin"]["address"].endswith(f":{status[0][1].group(2)}")
    pids = {m.group(1): m.group(2) for m in map(PIDS.match, lines) if m}
    assert set(pids) == {"trimtab", "least_request"}
    started = [int(p.split()[1]) for text in pids.values() for p in text.split(", ")]
    assert len(started) == 5  # sim, envoy, trimtab; then sim, envoy
    assert [pid for pid in started if _alive(pid)] == []
    assert _group_members(pgid) == []
