"""xds_server/config/load.py's file bounds: only a regular file is read, and the reload's
read runs off the loop, bounded in time."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, suppress
from pathlib import Path

import pytest

from xds_server.config import load
from xds_server.config.load import ConfigError, load_config

POOL = "pools:\n- name: p\n  model: m\n  endpoints: [{address: 127.0.0.1:8001}]\n"
PROMPT_S = 2.0  # a refusal comes at once; a blocked read would take until the FIFO is written


@contextmanager
def unblocking(fifo: Path) -> Iterator[None]:
    """On the way out, open the FIFO's write end if a reader is blocked on it (so a test of
    code that does block ends instead of hanging), then remove it."""
    try:
        yield
    finally:
        with suppress(OSError):  # ENXIO: nobody is reading
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fifo.unlink(missing_ok=True)


def finishes(call: Callable[[], object], within: float) -> tuple[bool, object]:
    """Run ``call`` in a thread; (finished within ``within`` s, its result or exception)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    return not thread.is_alive(), (outcome[0] if outcome else None)


def test_a_fifo_is_refused_at_once_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "trimtab.yaml"
    os.mkfifo(fifo)
    with unblocking(fifo):
        done, outcome = finishes(lambda: load_config(fifo), PROMPT_S)
    assert done, f"load_config blocked on a FIFO for over {PROMPT_S}s"
    assert isinstance(outcome, ConfigError)
    assert outcome.problems == [("", f"{fifo}: is a FIFO (named pipe); a config must be a "
                                     f"regular file, refused without reading it")]


def test_a_directory_and_a_socket_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory; a config must be a regular file"):
        load_config(tmp_path)
    path = tmp_path / "s"
    with closing(socket.socket(socket.AF_UNIX)) as sock:
        sock.bind(str(path))
        with pytest.raises(ConfigError, match="is a socket; a config must be a regular file"):
            load_config(path)


def test_a_fifo_swapped_in_after_the_check_does_not_block(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The check on the path and the open are two steps: the open is non-blocking and the
    open descriptor is checked again."""
    fifo = tmp_path / "trimtab.yaml"
    os.mkfifo(fifo)
    real_stat = os.stat
    monkeypatch.setattr(load.os, "stat", lambda p: real_stat(tmp_path / "regular"))
    (tmp_path / "regular").write_text(POOL)
    with unblocking(fifo):
        done, outcome = finishes(lambda: load_config(fifo), PROMPT_S)
    assert done and isinstance(outcome, ConfigError), outcome
    assert "is a FIFO (named pipe)" in str(outcome)


def test_a_regular_file_and_a_symlink_to_one_still_load(tmp_path: Path) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(POOL)
    link = tmp_path / "link.yaml"
    link.symlink_to(path)
    assert load_config(link).pools[0].name == "p"


def test_the_off_loop_read_lets_the_loop_run_and_is_bounded_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trimtab.yaml"
    path.write_text(POOL)
    release = threading.Event()

    def slow_load(where: str | Path) -> object:
        release.wait(5.0)
        return "loaded"

    monkeypatch.setattr(load, "load_config", slow_load)

    async def scenario() -> tuple[int, str, float]:
        beats = 0

        async def heartbeat() -> None:
            nonlocal beats
            while True:
                await asyncio.sleep(0.01)
                beats += 1

        beating = asyncio.create_task(heartbeat())
        started = time.monotonic()
        with pytest.raises(ConfigError) as caught:
            await load.load_config_off_loop(path, timeout=0.3)
        elapsed = time.monotonic() - started
        beating.cancel()
        release.set()
        return beats, str(caught.value), elapsed

    beats, message, elapsed = asyncio.run(scenario())
    assert message == f"{path}: not read and validated within 0.3s; refused"
    assert elapsed < 3.0
    assert beats >= 5  # the loop ran while the file was being read
