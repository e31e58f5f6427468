"""What `make demo` shows while a run lasts: one row per endpoint (GPU, trimtab's weight,
queue, KV use, recent ITL, share of requests), refreshed in place with rich on a terminal or
printed as a compact table every few seconds otherwise."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trimtab_dev.bench import envoy_configs, report
from trimtab_dev.bench.fleet import Fleet
from trimtab_dev.bench.runner import Counters, LoadPlan
from trimtab_dev.bench.samplers import Sampler, sim_stats, trimtab_weights
from trimtab_dev.bench.stack import PolicyStack
from trimtab_dev.loadgen.runner import RequestRecord

LIVE_EVERY_S = 1.0
PLAIN_EVERY_S = 10.0
ITL_WINDOW_S = 15.0
COLUMNS = ("endpoint", "GPU", "weight", "queue", "KV use", "ITL", "expected", "share")


# ---- what the live table shows --------------------------------------------------------------
@dataclass(frozen=True)
class EndpointRow:
    name: str
    gpu: str
    weight: int | None
    waiting: int | None
    kv_usage: float | None
    itl_ms: float | None
    requests: int
    share: float | None  # measured: of the requests Envoy sent so far
    # what the weights ask for, as the status page shows it (locality weight x host weight,
    # priorities and health: weight_calculator.localities.document_shares)
    expected: float | None = None
    tier: str | None = None  # the endpoint's locality (capacity tier) and its weight

    def cells(self) -> list[str]:
        weight = _opt(self.weight) + (f" × {self.tier}" if self.tier else "")
        return [self.name, self.gpu, weight, _opt(self.waiting),
                "-" if self.kv_usage is None else f"{100 * self.kv_usage:.0f}%",
                "-" if self.itl_ms is None else f"{self.itl_ms:.1f} ms",
                "-" if self.expected is None else f"{100 * self.expected:.1f}%",
                "-" if self.share is None else f"{100 * self.share:.1f}% ({self.requests})"]


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def envoy_host_requests(document: dict[str, Any]) -> dict[str, int]:
    """``/clusters?format=json`` -> ``{address: rq_total}`` of the bench cluster."""
    for status in document.get("cluster_statuses", []):
        if status.get("name") != envoy_configs.CLUSTER:
            continue
        out = {}
        for host in status.get("host_statuses", []):
            sock = host.get("address", {}).get("socket_address", {})
            stats = {s.get("name"): int(s.get("value", 0)) for s in host.get("stats", [])}
            out[f"{sock.get('address')}:{sock.get('port_value')}"] = stats.get("rq_total", 0)
        return out
    return {}


@dataclass
class RunView:
    """The live state of one run: its samplers' latest samples, counters and recent ITLs."""

    policy: str
    fleet: Fleet
    plan: LoadPlan
    samplers: dict[str, Sampler]
    counters: Counters = field(default_factory=Counters)
    itl: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    status_url: str | None = None

    def on_record(self, rec: RequestRecord) -> None:
        if rec.error is None and rec.tpot is not None and rec.server is not None:
            self.itl.setdefault(rec.server, deque()).append((time.monotonic(), rec.tpot))

    def latest(self, name: str) -> Any:
        sampler = self.samplers.get(name)
        return sampler.samples[-1][1] if sampler is not None and sampler.samples else None

    def itl_ms(self, server: str) -> float | None:
        recent = self.itl.get(server, deque())
        while recent and recent[0][0] < time.monotonic() - ITL_WINDOW_S:
            recent.popleft()
        return 1e3 * sum(v for _, v in recent) / len(recent) if recent else None

    def rows(self) -> list[EndpointRow]:
        weights = self.latest("trimtab_weights") or {}
        servers = (self.latest("sim") or {}).get("servers", {})
        routed = self.latest("envoy_requests") or {}
        total = sum(routed.values())
        expected = report.effective_shares(weights) if weights else {}
        rows = []
        for s in self.fleet.servers:
            state, count = servers.get(s.name, {}), routed.get(s.address, 0)
            mine = weights.get(s.address, {})
            tier = (f"{mine['locality']} {mine.get('locality_weight') or 1}"
                    if mine.get("locality") else None)
            rows.append(EndpointRow(s.name, s.gpu, mine.get("weight"), state.get("waiting"),
                                    state.get("kv_usage"), self.itl_ms(s.name), count,
                                    count / total if total else None,
                                    expected.get(s.address), tier))
        return rows

    def headline(self) -> str:
        c, sim = self.counters, self.latest("sim") or {}
        lag = sim.get("loop_lag_p99_ms")
        elapsed, total = time.monotonic() - self.started, self.plan.total
        clock = (f"{elapsed:.0f}/{total:.0f} s" if elapsed <= total else
                 f"{total:.0f} s sent, tail {elapsed - total:.0f}/{self.plan.tail_s:.0f} s")
        label = "trimtab weights" if self.policy == "trimtab" else f"{self.policy} (unweighted)"
        return (f"{label}  {clock}  {self.plan.rate:g} req/s  sent {c.sent}  answered "
                f"{c.done}  in flight "
                f"{c.sent - c.done}  errors {c.errors}  sim loop lag p99 "
                f"{'-' if lag is None else f'{lag:.1f} ms'}")


def samplers(stack: PolicyStack, interval: float) -> dict[str, Sampler]:
    """Sim stats and Envoy's per-host requests every second; trimtab's weights every tick."""
    out = {"sim": Sampler("sim", stack.fleet.stats_url, LIVE_EVERY_S, sim_stats),
           "envoy_requests": Sampler("envoy_requests",
                                     f"{stack.envoy_admin_url}/clusters?format=json",
                                     LIVE_EVERY_S, envoy_host_requests)}
    if stack.trimtab_admin_url is not None:
        out["trimtab_weights"] = Sampler("trimtab_weights",
                                         f"{stack.trimtab_admin_url}/v1/weights", interval,
                                         trimtab_weights)
    return out


def status_banner(url: str) -> str:
    """The line that tells a newcomer where trimtab's live status page (admin ``/``) is."""
    return (f"\n>>> trimtab's live status page: {url}  (open it in a browser while the demo "
            f"runs: each endpoint's weight over time, signals, NACKs, rollouts)\n")


# ---- displays ---------------------------------------------------------------------------------
class PlainDisplay:
    """A compact text table every :data:`PLAIN_EVERY_S` seconds, and one at the end."""

    def __init__(self) -> None:
        self.last = 0.0

    def start(self) -> None:
        self.last = time.monotonic()

    def show(self, view: RunView, final: bool = False) -> None:
        if not final and time.monotonic() - self.last < PLAIN_EVERY_S:
            return
        self.last = time.monotonic()
        table = report.plain_table(COLUMNS, [r.cells() for r in view.rows()])
        print(f"\n{'final: ' if final else ''}{view.headline()}\n{table}", flush=True)

    def stop(self) -> None:
        pass

    def say(self, text: str) -> None:
        print(text, flush=True)


class LiveDisplay:
    """A rich table refreshed in place every second; the last one stays on screen."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console()
        self.live: Any = None

    def start(self) -> None:
        from rich.live import Live

        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.live.start()

    def show(self, view: RunView, final: bool = False) -> None:
        from rich.table import Table

        caption = None if view.status_url is None else f"status page: {view.status_url}"
        table = Table(title=view.headline(), title_justify="left", caption=caption,
                      caption_justify="left")
        for i, column in enumerate(COLUMNS):
            table.add_column(column, justify="left" if i < 2 else "right")
        for row in view.rows():
            table.add_row(*row.cells())
        if self.live is not None:
            self.live.update(table, refresh=True)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)


Display = PlainDisplay | LiveDisplay
