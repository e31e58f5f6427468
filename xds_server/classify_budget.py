"""A wall-clock budget for one classifier decision, kept by SIGALRM.

An operator's regular expression can backtrack: ``.*error.*traceback`` costs time cubic in
the text (4,000 characters: 1.4 s; 8,000: over 10 s), and while Python's ``re`` runs, the
classifier's event loop answers nobody. ``re`` checks for signals while it matches, and Python
code checks between bytecodes, so `run_within` arms a one-shot real-time interval timer whose
handler raises `OverBudget`: the decision stops within about a millisecond of its budget.
C code that checks no signals (``json.loads``) runs to its end first; the body's byte bound
bounds it.

Signal handlers run in the main thread only, so the budget is kept there (the classifier's
event loop runs in its process's main thread); a call from another thread runs unbounded.
SIGALRM is borrowed for the call: the previous handler and any pending timer are put back.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


class OverBudget(BaseException):
    """A decision ran past its budget. A BaseException, so that a learned classifier's
    ``except Exception`` does not swallow it."""


class _Alarm:
    """The SIGALRM handler of one call: raises only while that call runs."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise OverBudget


def run_within(seconds: float, call: Callable[[], T]) -> T:
    """`call()`, stopped with `OverBudget` after `seconds` of wall time (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return call()
    alarm = _Alarm()
    previous: Any = signal.signal(signal.SIGALRM, alarm)
    pending, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        return call()
    finally:
        alarm.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        _restore(previous, pending, interval, time.monotonic() - started)


def _restore(handler: Any, pending: float, interval: float, elapsed: float) -> None:
    """Put back the handler and the timer someone else had set (pytest-timeout, say)."""
    if handler is not None:  # None: installed outside Python; ours stays, unarmed
        signal.signal(signal.SIGALRM, handler)
    if pending > 0:
        signal.setitimer(signal.ITIMER_REAL, max(pending - elapsed, 1e-6), interval)
