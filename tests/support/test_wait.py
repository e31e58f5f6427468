"""The polling helper: it returns the first value that passes, and a timeout names what was
awaited and the last value seen."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.support.wait import wait_until, wait_until_async


def test_wait_until_returns_the_first_value_that_passes_the_check() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 5.0, "three", check=lambda n: n >= 3, every=0) == 3


def test_wait_until_fails_naming_what_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=r"waiting for the flag; last: 'no'"):
        wait_until(lambda: "no", 0.05, "the flag", check=lambda v: v == "yes", every=0.01)


def test_wait_until_async_awaits_coroutine_probes_and_times_out() -> None:
    calls: list[int] = []

    async def probe() -> int:
        calls.append(1)
        return len(calls)

    async def body() -> None:
        assert await wait_until_async(probe, 5.0, check=lambda n: n == 4, every=0) == 4
        with pytest.raises(AssertionError, match="waiting for never"):
            await wait_until_async(lambda: False, 0.05, "never")

    asyncio.run(body())
