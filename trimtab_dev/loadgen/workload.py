"""Workload specs and their deterministic open-loop schedules.

A workload (YAML) gives an arrival process at a mean rate, a mixture of request classes
(prompt-length and max_tokens distributions), model names and wire options.
:func:`build_schedule` turns it into a list of :class:`PlannedRequest` that depends only on
the seed, the rate and the duration. Arrival times and request attributes use separate
random streams, so the k-th request has the same class and sizes at every rate of a sweep.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class WorkloadError(ValueError):
    """The workload spec is invalid."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Dist(_Strict):
    """An integer distribution: fixed, uniform, loguniform, or lognormal clipped to [min, max]."""

    dist: Literal["fixed", "uniform", "loguniform", "lognormal"] = "uniform"
    value: int | None = Field(None, ge=1)
    min: int | None = Field(None, ge=1)
    max: int | None = Field(None, ge=1)
    median: float | None = Field(None, gt=0)
    sigma: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Dist:
        if self.dist == "fixed":
            if self.value is None:
                raise ValueError("a fixed distribution needs 'value'")
            return self
        if self.min is None or self.max is None or self.min > self.max:
            raise ValueError(f"a {self.dist} distribution needs min <= max")
        if self.dist == "lognormal" and (self.median is None or self.sigma is None):
            raise ValueError("a lognormal distribution needs 'median' and 'sigma'")
        return self

    def sample(self, rng: random.Random) -> int:
        if self.dist == "fixed":
            return int(self.value or 1)
        lo, hi = int(self.min or 1), int(self.max or 1)
        if self.dist == "uniform":
            return rng.randint(lo, hi)
        if self.dist == "loguniform":
            x = math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))
        else:
            x = rng.lognormvariate(math.log(self.median or 1.0), self.sigma or 1.0)
        return max(lo, min(hi, int(x)))


class RequestClass(_Strict):
    name: str = Field(min_length=1)
    weight: float = Field(gt=0)
    prompt_tokens: Dist
    max_tokens: Dist
    # Optional request features (defaults leave the body exactly as before):
    images: int = Field(0, ge=0, le=16, description="image_url parts per chat request")
    text_prefix: str | None = Field(None, max_length=4096,
                                    description="put first in the prompt (e.g. an intent)")
    stream: bool | None = Field(None, description="override the workload's stream")


class ModelChoice(_Strict):
    name: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0)


class Arrival(_Strict):
    """Poisson at ``rate``; on/off modulated Poisson with the same mean rate (``bursty``:
    ``on_s`` seconds at ``burst_factor`` x rate, then ``off_s`` seconds at whatever rate
    keeps the mean, 0 when burst_factor = (on_s + off_s) / on_s); or a ``surge``: Poisson at
    ``rate``, then ``factor`` x rate for ``surge_s`` seconds from ``start_s`` (seconds after
    the schedule's first instant), then ``rate`` again (``rate`` is the steady rate, not the
    mean)."""

    kind: Literal["poisson", "bursty", "surge"] = "poisson"
    on_s: float = Field(5.0, gt=0)
    off_s: float = Field(5.0, gt=0)
    burst_factor: float = Field(2.0, ge=1)
    start_s: float = Field(60.0, ge=0, description="surge: when it starts")
    surge_s: float = Field(15.0, gt=0, description="surge: how long it lasts")
    factor: float = Field(8.0, ge=1, description="surge: its rate over the steady rate")

    @model_validator(mode="after")
    def _check(self) -> Arrival:
        if self.on_s * self.burst_factor > self.on_s + self.off_s + 1e-9:
            raise ValueError("burst_factor too high: the off-period rate would be negative")
        return self


class Flood(_Strict):
    """One tenant sending ``factor`` x its share: the other tenants' requests are the same
    as without the flood; the flooding tenant's extra ``factor - 1`` shares arrive on top,
    over the whole run or only during the surge (``during: surge``)."""

    tenant: str = Field(min_length=1)
    factor: float = Field(5.0, ge=1)
    during: Literal["run", "surge"] = "run"


class Tenants(_Strict):
    """``count`` tenants named ``t0`` .. ``t<count-1>``, each request drawn uniformly among
    them (a random stream of its own), sent in the ``header`` request header."""

    header: str = Field("x-tenant", min_length=1, pattern=r"^[A-Za-z0-9-]+$")
    count: int = Field(4, ge=1, le=1000)
    flood: Flood | None = None

    @property
    def names(self) -> list[str]:
        return [f"t{i}" for i in range(self.count)]

    @model_validator(mode="after")
    def _check(self) -> Tenants:
        if self.flood is not None and self.flood.tenant not in self.names:
            raise ValueError(f"flood.tenant must be one of t0..t{self.count - 1}")
        return self


class Sweep(_Strict):
    rates: list[float] = Field(min_length=1)
    duration_s: float | None = Field(None, gt=0)


class Workload(_Strict):
    name: str = "workload"
    seed: int = 0
    rate: float = Field(gt=0, description="mean arrivals per second")
    duration_s: float = Field(gt=0)
    arrival: Arrival = Arrival()
    endpoint: Literal["chat", "completions"] = "chat"
    stream: bool = True
    models: list[ModelChoice] = Field(
        default_factory=lambda: [ModelChoice(name="meta-llama/Llama-3.1-8B-Instruct")])
    classes: list[RequestClass] = Field(min_length=1)
    realistic_bodies: bool = Field(False, description="send ~4 bytes of text per token")
    max_prompt_bytes: int = Field(1024, ge=1, description="text cap when not realistic")
    timeout_s: float = Field(300.0, gt=0)
    max_connections: int = Field(4096, ge=1)
    sweep: Sweep | None = None
    tenants: Tenants | None = None
    ttft_slo_s: float | None = Field(None, gt=0, description="the TTFT SLO a judge uses "
                                                             "(trimtab bench's surge report)")

    @model_validator(mode="after")
    def _check(self) -> Workload:
        flood = self.tenants.flood if self.tenants else None
        if flood is not None and flood.during == "surge" and self.arrival.kind != "surge":
            raise ValueError("tenants.flood.during: surge needs arrival.kind: surge")
        return self


def parse_workload(data: Any) -> Workload:
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(str(exc)) from exc


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file; raises :class:`WorkloadError`."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from exc
    return parse_workload(data)


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at: float  # seconds after the run starts
    cls: str
    model: str
    prompt_tokens: int
    max_tokens: int
    tenant: str | None = None


def surge_window(arrival: Arrival) -> tuple[float, float] | None:
    """``(start, end)`` of the surge in schedule seconds, or None for other kinds."""
    if arrival.kind != "surge":
        return None
    return arrival.start_s, arrival.start_s + arrival.surge_s


def rate_segments(arrival: Arrival, rate: float, duration: float) -> list[tuple[float, float]]:
    """The arrival process as consecutive ``(length, rate)`` segments covering
    ``[0, duration)``."""
    if arrival.kind == "poisson":
        return [(duration, rate)]
    if arrival.kind == "surge":
        return _surge_segments(arrival, rate, duration)
    hi = rate * arrival.burst_factor
    lo = max(0.0, rate * (arrival.on_s + arrival.off_s - arrival.on_s
                          * arrival.burst_factor) / arrival.off_s)
    segments = []
    t, on = 0.0, True
    while t < duration:
        length = arrival.on_s if on else arrival.off_s
        segments.append((min(length, duration - t), hi if on else lo))
        t += length
        on = not on
    return segments


def _surge_segments(arrival: Arrival, rate: float, duration: float
                    ) -> list[tuple[float, float]]:
    start, end = (min(t, duration) for t in (arrival.start_s, arrival.start_s + arrival.surge_s))
    parts = [(start, rate), (end - start, rate * arrival.factor), (duration - end, rate)]
    return [(length, r) for length, r in parts if length > 0]


def arrival_times(arrival: Arrival, rate: float, duration: float,
                  rng: random.Random) -> list[float]:
    """Open-loop arrival instants in ``[0, duration)``."""
    return _piecewise_poisson(rate_segments(arrival, rate, duration), rng)


def _piecewise_poisson(segments: list[tuple[float, float]], rng: random.Random) -> list[float]:
    """Poisson arrivals over consecutive ``(length, rate)`` segments (time rescaling)."""
    out: list[float] = []
    start = 0.0
    need = rng.expovariate(1.0)  # integrated intensity until the next arrival
    for length, rate in segments:
        t, end = start, start + length
        while rate > 0 and need <= rate * (end - t):
            t += need / rate
            out.append(t)
            need = rng.expovariate(1.0)
        if rate > 0:
            need -= rate * (end - t)
        start = end
    return out


def _pick(rng: random.Random, items: list[Any], weights: list[float]) -> Any:
    return rng.choices(items, weights=weights, k=1)[0]


def sample_request(w: Workload, rng: random.Random) -> tuple[str, str, int, int]:
    """``(class, model, prompt_tokens, max_tokens)`` for one request."""
    cls = _pick(rng, w.classes, [c.weight for c in w.classes])
    model = _pick(rng, w.models, [m.weight for m in w.models])
    return cls.name, model.name, cls.prompt_tokens.sample(rng), cls.max_tokens.sample(rng)


def build_schedule(w: Workload, *, rate: float | None = None, duration: float | None = None,
                   seed: int | None = None) -> list[PlannedRequest]:
    """The run's requests in send order; same inputs, same schedule. Tenants (and a flood's
    extra requests) come from random streams of their own, so the requests of a workload
    without tenants are the same with them."""
    seed = w.seed if seed is None else seed
    rate, duration = rate or w.rate, duration or w.duration_s
    times = arrival_times(w.arrival, rate, duration, random.Random(f"{seed}/arrivals/{rate}"))
    attrs = random.Random(f"{seed}/requests")
    out = [PlannedRequest(i, t, *sample_request(w, attrs)) for i, t in enumerate(times)]
    if w.tenants is None:
        return out
    return _with_tenants(out, w, w.tenants, rate, duration, seed)


def _with_tenants(base: list[PlannedRequest], w: Workload, tenants: Tenants, rate: float,
                  duration: float, seed: int) -> list[PlannedRequest]:
    """Each request's tenant, plus the flooding tenant's extra requests, re-indexed in time
    order."""
    pick = random.Random(f"{seed}/tenants")
    tagged = [replace(p, tenant=pick.choice(tenants.names)) for p in base]
    flood = tenants.flood
    if flood is None or flood.factor == 1:
        return tagged
    share = rate * (flood.factor - 1) / tenants.count
    times = _piecewise_poisson(_flood_segments(w.arrival, flood, share, duration),
                               random.Random(f"{seed}/flood/{rate}"))
    attrs = random.Random(f"{seed}/flood-requests")
    extra = [PlannedRequest(0, t, *sample_request(w, attrs), tenant=flood.tenant)
             for t in times]
    merged = sorted(tagged + extra, key=lambda p: p.at)
    return [replace(p, index=i) for i, p in enumerate(merged)]


def _flood_segments(arrival: Arrival, flood: Flood, share_rate: float, duration: float
                    ) -> list[tuple[float, float]]:
    """The flood's extra intensity: ``share_rate`` shaped like the arrival process, and 0
    outside the surge when ``during: surge``."""
    segments = rate_segments(arrival, share_rate, duration)
    window = surge_window(arrival)
    if flood.during == "run" or window is None:
        return segments
    out, t = [], 0.0
    for length, r in segments:
        out.append((length, r if window[0] <= t < window[1] else 0.0))
        t += length
    return out


def request_headers(p: PlannedRequest, w: Workload) -> dict[str, str]:
    """The request's headers: JSON, and its tenant when the workload has tenants."""
    headers = {"Content-Type": "application/json"}
    if p.tenant is not None and w.tenants is not None:
        headers[w.tenants.header] = p.tenant
    return headers


def request_samples(w: Workload, n: int, seed: int | None = None) -> list[tuple[int, int]]:
    """``n`` ``(prompt_tokens, max_tokens)`` pairs from the workload's mixture."""
    rng = random.Random(f"{w.seed if seed is None else seed}/requests")
    return [sample_request(w, rng)[2:] for _ in range(n)]


_FILLER = ("lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
           "incididunt ut labore et dolore magna aliqua ") * 64


def prompt_text(tokens: int, w: Workload) -> str:
    """Synthetic text of ~4 bytes per token, capped unless ``realistic_bodies``."""
    size = 4 * tokens if w.realistic_bodies else min(4 * tokens, w.max_prompt_bytes)
    reps = size // len(_FILLER) + 1
    return (_FILLER * reps)[:size]


# A 1x1 PNG: the part's shape is what routing sees; the size in tokens is in prompt_tokens.
IMAGE_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4"
             "nGNgYGBgAAAABQABpfZFQAAAAABJRU5ErkJggg==")


def _class(w: Workload, name: str) -> RequestClass | None:
    return next((c for c in w.classes if c.name == name), None)


def request_streams(p: PlannedRequest, w: Workload) -> bool:
    """Whether the request asks for a stream (its class may override the workload)."""
    cls = _class(w, p.cls)
    return w.stream if cls is None or cls.stream is None else cls.stream


def request_body(p: PlannedRequest, w: Workload) -> bytes:
    """The JSON body for one planned request (OpenAI shape plus the ``prompt_tokens`` hint)."""
    cls = _class(w, p.cls)
    text = prompt_text(p.prompt_tokens, w)
    if cls is not None and cls.text_prefix:
        text = f"{cls.text_prefix} {text}"
    stream = request_streams(p, w)
    body: dict[str, Any] = {"model": p.model, "max_tokens": p.max_tokens, "stream": stream,
                            "ignore_eos": True, "prompt_tokens": p.prompt_tokens}
    if w.endpoint == "chat":
        content: Any = text
        if cls is not None and cls.images:
            image = {"type": "image_url", "image_url": {"url": IMAGE_URL}}
            content = [{"type": "text", "text": text}, *[image] * cls.images]
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = text
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


def endpoint_path(w: Workload) -> str:
    return "/v1/chat/completions" if w.endpoint == "chat" else "/v1/completions"
