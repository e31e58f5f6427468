"""`python -m trimtab_dev.demo.local`: trimtab steering a real Envoy, on this machine.

Starts three fake GPU backends whose framebuffer use drifts, `trimtab serve` on
examples/local-fake-gpus.yaml (examples/local.yaml weighing by GPU memory, with round robin,
as fake backends that serve only DCGM gauges need) and Envoy on envoy-bootstrap.yaml, sends traffic for the example's model
through Envoy's listener, prints the weights every tick and the observed traffic split, and
stops everything it started (also on Ctrl-C). Ports come from those two files; every one can
be overridden (``--backend-ports``, ``--xds-port``, ...), which makes patched copies of them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from trimtab_dev.bench.processes import stop_process
from trimtab_dev.demo.fake_gpu import DemoBackends
from trimtab_dev.demo.layout import DemoError, Layout, check_ports_free, prepare_layout
from trimtab_dev.envoy_process import EnvoyError, EnvoyProcess

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "examples" / "local-fake-gpus.yaml"
DEFAULT_BOOTSTRAP = ROOT / "envoy-bootstrap.yaml"
READY_TIMEOUT_S = 20.0
DRIFT_PERIOD_S = 30.0
STOP_TIMEOUT_S = 5.0


@dataclass
class Traffic:
    """Sends requests for `model` through Envoy from a background thread and counts answers."""

    port: int
    model: str
    rate: float
    counts: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    last_error: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="demo-traffic", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "hi"}]})
        conn: http.client.HTTPConnection | None = None
        while not self._stop.wait(1.0 / self.rate):
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("POST", "/v1/chat/completions", body,
                             {"content-type": "application/json"})
                resp = conn.getresponse()
                answer = json.loads(resp.read())
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {answer}")
                with self._lock:
                    self.counts[answer["backend"]] = self.counts.get(answer["backend"], 0) + 1
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self.errors, self.last_error = self.errors + 1, str(exc)[:200]
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()


def _http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Demo:
    """Owns every process and thread the demo starts; `close()` stops all of them by PID."""

    def __init__(self, layout: Layout, workdir: Path, rate: float) -> None:
        self.layout = layout
        self.workdir = workdir
        self.backends = DemoBackends(layout.backends)
        self.envoy = EnvoyProcess(log_level="warning")
        self.trimtab: subprocess.Popen[bytes] | None = None
        self.traffic = Traffic(layout.listener, layout.pool["model"], rate)
        self.addresses = [f"127.0.0.1:{port}" for port in layout.backends]

    def start(self) -> None:
        self.backends.start()
        self.drift(0.0)
        cmd = [sys.executable, "-m", "xds_server.cli", "serve", "--config",
               str(self.layout.config_path)]
        print(f"demo: starting {' '.join(cmd[2:])} (log: {self.workdir / 'trimtab.log'})")
        with (self.workdir / "trimtab.log").open("wb") as log:
            self.trimtab = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        self._wait_trimtab()
        print(f"demo: starting Envoy (admin http://127.0.0.1:{self.layout.envoy_admin}, "
              f"listener :{self.layout.listener})")
        self.envoy.start(self.layout.bootstrap, self.workdir / "envoy.log")
        self.envoy.wait_ready(READY_TIMEOUT_S)
        self._wait_listener()
        self.traffic.start()

    def _wait_trimtab(self) -> None:
        url = f"http://127.0.0.1:{self.layout.admin}/readyz"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.trimtab is None or self.trimtab.poll() is not None:
                raise DemoError(f"trimtab exited early; log tail:\n{self.log_tail('trimtab.log')}")
            try:
                _http_json(url, timeout=0.5)
                return
            except OSError:
                time.sleep(0.1)
        raise DemoError(f"trimtab not ready after {READY_TIMEOUT_S:g}s")

    def _wait_listener(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.layout.listener)) == 0:
                    return
            time.sleep(0.1)
        raise DemoError(f"Envoy listener :{self.layout.listener} not up after {READY_TIMEOUT_S:g}s")

    def drift(self, elapsed: float) -> None:
        """GPU memory use drifts: three sine waves a third of a period apart, 15..85 %."""
        for index in range(len(self.layout.backends)):
            phase = 2 * math.pi * (elapsed / DRIFT_PERIOD_S + index / 3)
            self.backends.set_used_pct(index, 50 + 35 * math.sin(phase))

    def weights(self) -> tuple[dict[str, Any], dict[str, int]]:
        """trimtab's view (/v1/weights) and Envoy's (/clusters) of the pool."""
        pool = self.layout.pool["name"]
        document = _http_json(f"http://127.0.0.1:{self.layout.admin}/v1/weights")
        try:
            envoy = self.envoy.host_weights(pool)
        except (EnvoyError, OSError, ValueError):
            envoy = {}
        return document["pools"].get(pool, {}), envoy

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / name
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        self.traffic.stop()
        try:
            self.envoy.stop(STOP_TIMEOUT_S)
        finally:
            stop_process(self.trimtab)
            self.trimtab = None
            self.backends.stop()


@dataclass
class Split:
    """Requests seen per backend, and the share the weights asked for over the same windows."""

    addresses: list[str]
    observed: dict[str, int] = field(default_factory=dict)
    expected: dict[str, float] = field(default_factory=dict)

    def add(self, window: dict[str, int], weights: dict[str, int]) -> None:
        requests, total = sum(window.values()), sum(weights.get(a, 0) for a in self.addresses)
        if not requests or not total:
            return
        for address in self.addresses:
            self.observed[address] = self.observed.get(address, 0) + window.get(address, 0)
            share = weights.get(address, 0) / total
            self.expected[address] = self.expected.get(address, 0.0) + requests * share

    def total(self) -> int:
        return sum(self.observed.values())


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:3.0f}%" if whole else "   -"


def print_header(addresses: list[str]) -> None:
    cells = "".join(f" | {address:<26}" for address in addresses)
    print(f"{'t':>6}{cells}")
    print(f"{'':>6}" + f" | {'mem':>6}  {'wt':>5}  {'envoy':>5}  {'sent':>4}" * len(addresses))
    print("  (mem: GPU memory in use; wt: trimtab's weight, * = stale telemetry; envoy: the weight"
          " in Envoy's /clusters; sent: share of this tick's requests)")


def print_row(elapsed: float, addresses: list[str], trimtab: dict[str, Any],
              envoy: dict[str, int], window: dict[str, int]) -> None:
    requests = sum(window.values())
    cells = []
    for address in addresses:
        info = trimtab.get(address, {})
        mem = info.get("signals", {}).get("gpu_mem_pct")
        mem_text = f"{mem:5.1f}%" if mem is not None else "    - "
        stale = "*" if info.get("stale") else " "
        cells.append(f" | {mem_text}  {info.get('weight', '-'):>5}{stale} {envoy.get(address, '-'):>5} "
                     f" {_pct(window.get(address, 0), requests)}")
    print(f"{elapsed:5.1f}s" + "".join(cells) + f"   ({requests} req)", flush=True)


def print_summary(split: Split, traffic: Traffic) -> None:
    total = split.total()
    print(f"\nsplit: {total} requests through Envoy "
          f"(expected = Envoy's weights over the same windows), {traffic.errors} errors")
    for address in split.addresses:
        print(f"  {address:<22} observed {_pct(split.observed.get(address, 0), total)}"
              f"   weights {_pct(split.expected.get(address, 0.0), total)}")
    if traffic.errors:
        print(f"  last error: {traffic.last_error}")


def run(demo: Demo, duration: float) -> Split:
    interval = demo.layout.interval
    split = Split(demo.addresses)
    started = time.monotonic()
    previous = demo.traffic.snapshot()
    print_header(demo.addresses)
    envoy_weights: dict[str, int] = {}
    while (elapsed := time.monotonic() - started) < duration:
        time.sleep(min(interval, max(duration - elapsed, 0.0)))
        elapsed = time.monotonic() - started
        demo.drift(elapsed)
        counts = demo.traffic.snapshot()
        window = {a: counts.get(a, 0) - previous.get(a, 0) for a in demo.addresses}
        previous = counts
        split.add(window, envoy_weights)  # traffic of the window just ended, weights it ran on
        trimtab_view, envoy_weights = demo.weights()
        print_row(elapsed, demo.addresses, trimtab_view, envoy_weights, window)
    return split


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trimtab_dev.demo.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=45.0, help="seconds to run (45)")
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second (50)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="trimtab config")
    parser.add_argument("--bootstrap", default=str(DEFAULT_BOOTSTRAP), help="Envoy bootstrap")
    parser.add_argument("--backend-ports", type=_ports, help="three ports, e.g. 8001,8002,8003")
    for name, what in (("xds", "trimtab xDS"), ("admin", "trimtab admin"),
                       ("listener", "Envoy listener"), ("envoy-admin", "Envoy admin")):
        parser.add_argument(f"--{name}-port", type=int, help=f"{what} port (from the files)")
    return parser


def _ports(text: str) -> list[int]:
    ports = [int(part) for part in text.split(",")]
    if len(ports) != 3:
        raise argparse.ArgumentTypeError("give exactly three ports")
    return ports


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.signal(signal.SIGTERM, _interrupt)  # clean up on SIGTERM exactly as on Ctrl-C
    with tempfile.TemporaryDirectory(prefix="trimtab-demo-") as tmp:
        demo: Demo | None = None
        try:
            layout = prepare_layout(args, Path(tmp))
            check_ports_free(layout)
            demo = Demo(layout, Path(tmp), args.rate)
            demo.start()
            split = run(demo, args.duration)
            print_summary(split, demo.traffic)
            return 0 if split.total() else _fail("no request made it through Envoy")
        except DemoError as exc:
            return _fail(str(exc))
        except EnvoyError as exc:
            return _fail(f"Envoy: {exc}")
        except OSError as exc:
            return _fail(f"cannot start: {exc}")
        except KeyboardInterrupt:
            print("\ndemo: interrupted", file=sys.stderr)
            return 130
        finally:
            if demo is not None:
                _close_uninterrupted(demo)


def _close_uninterrupted(demo: Demo) -> None:
    """Stop everything; a second Ctrl-C or SIGTERM must not cut the clean-up short."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        demo.close()
        print("demo: stopped trimtab, Envoy and the backends", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fail(message: str) -> int:
    print(f"demo: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
