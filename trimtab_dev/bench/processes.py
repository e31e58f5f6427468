"""Child processes of a benchmark, started and stopped by PID (SIGTERM, then SIGKILL, always
reaped), and the small HTTP and port helpers that wait for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trimtab_dev.envoy_process import EnvoyError

STOP_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 30.0


class BenchError(RuntimeError):
    """A part of the benchmark could not start or stop; the message says which and why."""


# ---- child processes ----------------------------------------------------------------------
@dataclass
class ChildProcess:
    """A child process with its output in ``log_path``, stopped by PID."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.running():
            raise BenchError(f"{self.name} already running")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def check_alive(self) -> None:
        if not self.running():
            raise BenchError(f"{self.name} exited early; log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps."""
        proc, self.proc = self.proc, None
        stop_process(proc, timeout)

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM by PID, then SIGKILL after ``timeout``; always reaps."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
    except ProcessLookupError:
        proc.wait(timeout)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM while children are being stopped, so that a second Ctrl-C
    cannot cut the clean-up short (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cli_command(*args: str) -> list[str]:
    """``trimtab ARGS`` run with this interpreter."""
    return [sys.executable, "-m", "xds_server.cli", *args]


def http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_until(probe: Callable[[], bool], timeout: float, what: str,
               alive: Callable[[], None] | None = None) -> None:
    """Poll ``probe`` (exceptions count as not yet) until true; raise naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            if probe():
                return
        except (OSError, ValueError, EnvoyError):
            pass
        time.sleep(0.1)
    raise BenchError(f"timed out after {timeout:g}s waiting for {what}")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
