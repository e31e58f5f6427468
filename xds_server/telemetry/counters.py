"""Each endpoint's recent counter reads, for the ``queueing`` weight policy.

The controller records every good read (:meth:`ServiceHistory.record`); the policy gets the
reads as :class:`~weight_calculator.queueing.Reading` tuples and does the arithmetic itself
(pure). Bounded: at most ``max_samples`` reads per endpoint, and only endpoints of the
config are kept (:meth:`forget`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from weight_calculator.service_rate import Reading

MAX_SAMPLES = 64


def reading_from_signals(at: float, signals: Mapping[str, float]) -> Reading | None:
    """The counters and gauges of one read; None when it carries no work counter."""
    prompt, generated = signals.get("prompt_tokens"), signals.get("generation_tokens")
    if prompt is None and generated is None:
        return None
    return Reading(at=at, requests_done=signals.get("requests_done"),
                   tokens=(prompt or 0.0) + (generated or 0.0),
                   running=signals.get("running", 0.0), waiting=signals.get("queue", 0.0),
                   kv_usage=signals.get("kv_usage"), prompt_tokens=prompt)


class ServiceHistory:
    """Bounded per-endpoint history of :class:`Reading`s. Not thread-safe; one task."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 2:
            raise ValueError(f"max_samples must be >= 2, got {max_samples}")
        self._max = max_samples
        self._data: dict[str, deque[Reading]] = {}

    def record(self, address: str, at: float, signals: Mapping[str, float]) -> None:
        reading = reading_from_signals(at, signals)
        if reading is None:
            return
        history = self._data.setdefault(address, deque(maxlen=self._max))
        if history and at <= history[-1].at:  # the same sample again, or a clock step back
            if at < history[-1].at:
                history.clear()
            else:
                return
        history.append(reading)

    def readings(self, address: str) -> tuple[Reading, ...]:
        return tuple(self._data.get(address, ()))

    def forget(self, keep: set[str]) -> None:
        for address in [a for a in self._data if a not in keep]:
            del self._data[address]
