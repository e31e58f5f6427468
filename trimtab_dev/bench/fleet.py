"""The simulated fleet of one benchmark run: `trimtab sim` in a child process, and the servers
it reports ready."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trimtab_dev.bench.processes import (
    READY_TIMEOUT_S,
    BenchError,
    ChildProcess,
    cli_command,
    http_json,
    signals_deferred,
    wait_until,
)


# ---- the simulated fleet ------------------------------------------------------------------
@dataclass(frozen=True)
class FleetServer:
    name: str
    gpu: str
    address: str
    kv_capacity_tokens: int


@dataclass
class Fleet:
    """What ``trimtab sim`` said in its ready line, plus the served model name."""

    model: str
    servers: list[FleetServer]

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def stats_url(self) -> str:
        return f"http://{self.servers[0].address}/sim/stats"

    def name_of(self, address: str) -> str:
        return next((s.name for s in self.servers if s.address == address), address)


def parse_ready_line(text: str, model: str) -> Fleet | None:
    """The fleet from ``trimtab sim``'s ready line, or None if there is none (yet)."""
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "ready":
            servers = [FleetServer(s["name"], s["gpu"], s["address"],
                                   int(s.get("kv_capacity_tokens") or 0))
                       for s in event["servers"] if not s.get("dead")]
            return Fleet(model, servers)
    return None


class SimFleetProcess:
    """``trimtab sim --fleet F`` as a child process (its CPU is not the load generator's)."""

    def __init__(self, fleet_path: str | Path, model: str, workdir: Path) -> None:
        self.ready_file = workdir / "sim-ready.json"
        self.model = model
        self.child = ChildProcess("trimtab sim", cli_command(
            "sim", "--fleet", str(fleet_path), "--ready-file", str(self.ready_file)),
            workdir / "sim.log")
        self.fleet: Fleet | None = None

    def start(self, timeout: float = READY_TIMEOUT_S) -> Fleet:
        self.ready_file.unlink(missing_ok=True)
        self.child.start()

        def ready() -> bool:
            text = self.ready_file.read_text() if self.ready_file.exists() else ""
            self.fleet = parse_ready_line(text, self.model)
            return self.fleet is not None

        wait_until(ready, timeout, "the simulator's ready line", self.child.check_alive)
        assert self.fleet is not None
        if not self.fleet.servers:
            raise BenchError("the fleet has no live server")
        return self.fleet

    def stats(self) -> dict[str, Any]:
        assert self.fleet is not None
        return dict(http_json(self.fleet.stats_url))

    def wait_drained(self, timeout: float) -> float:
        """Wait until no server runs or queues anything; returns the seconds it took."""
        started = time.monotonic()

        def idle() -> bool:
            stats = self.stats()
            return stats.get("in_flight", 0) == 0 and all(
                s["running"] == 0 and s["waiting"] == 0 for s in stats["servers"])

        wait_until(idle, timeout, "the fleet to drain", self.child.check_alive)
        return time.monotonic() - started

    def stop(self) -> None:
        with signals_deferred():
            self.child.stop()
