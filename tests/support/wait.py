"""The one polling helper of the tests: wait until a probe's value passes a check, or fail
naming what was awaited and the last value seen."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _timed_out(timeout: float, what: str, value: object) -> AssertionError:
    return AssertionError(f"timed out after {timeout:.2f}s waiting for {what}; last: {value!r}")


def wait_until(probe: Callable[[], T], timeout: float = 5.0, what: str = "the condition",
               check: Callable[[T], object] = bool, every: float = 0.02) -> T:
    """Call ``probe`` every ``every`` seconds until ``check(value)`` holds; return that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if check(value):
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, value)
        time.sleep(every)


async def wait_until_async(probe: Callable[[], T | Awaitable[T]], timeout: float = 5.0,
                           what: str = "the condition", check: Callable[[T], object] = bool,
                           every: float = 0.01) -> T:
    """:func:`wait_until` on an event loop: sleeps with ``asyncio.sleep``; ``probe`` may be a
    coroutine function (or return an awaitable, e.g. ``asyncio.to_thread`` for a blocking one)."""
    deadline = time.monotonic() + timeout
    while True:
        value: Any = probe()
        if inspect.isawaitable(value):
            value = await value
        if check(value):
            return value  # type: ignore[no-any-return]
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what, value)
        await asyncio.sleep(every)
