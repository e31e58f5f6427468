"""Open-loop load runner: sends a schedule over aiohttp and times every response.

Requests are sent at their scheduled instants whether or not earlier ones have finished
(open loop), so a slow backend shows up as latency rather than as a lower offered rate.
Streaming responses are parsed as Server-Sent Events; the first event that carries text
sets TTFT, and TPOT is the mean gap between text events after the first.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from trimtab_dev.loadgen.refusals import REFUSAL_STATUS, read_error_answer
from trimtab_dev.loadgen.workload import (
    PlannedRequest,
    Workload,
    build_schedule,
    endpoint_path,
    request_body,
    request_headers,
    request_streams,
)

SERVER_HEADER = "x-sim-server"


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds; ``error`` is None on success and on
    a refusal (HTTP 429: ``refused``, ``e2e`` is the time to the answer). ``openai_error``
    and the ``retry_after`` fields describe any non-200 answer (None otherwise)."""

    index: int
    cls: str
    prompt_tokens: int
    max_tokens: int
    scheduled_at: float
    sent_at: float = 0.0
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    server: str | None = None
    tenant: str | None = None
    refused: bool = False
    openai_error: bool | None = None
    error_type: str | None = None
    error_code: str | None = None
    retry_after: str | None = None
    retry_after_s: float | None = None

    @property
    def served(self) -> bool:
        """Answered in full: neither failed nor refused."""
        return self.error is None and not self.refused

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Progress:
    """Live counters, handed to the progress callback."""

    total: int
    sent: int = 0
    done: int = 0
    errors: int = 0
    refused: int = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.done


@dataclass
class RunResult:
    records: list[RequestRecord]
    offered_rate: float
    duration_s: float
    wall_s: float
    targets: list[str]
    started_unix: float
    extra: dict = field(default_factory=dict)


class LagProbe:
    """The client's own event-loop lag and CPU: a busy client inflates every latency it
    measures, so the report carries these next to the results."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._cpu0 = time.process_time()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, loop.time() - t0 - self.interval))

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]

        def ms(q: float) -> float:
            return 1e3 * lags[min(len(lags) - 1, int(q * len(lags)))]

        return {"loop_lag_p50_ms": ms(0.5), "loop_lag_p99_ms": ms(0.99), "loop_lag_max_ms": ms(1),
                "cpu_seconds": time.process_time() - self._cpu0}


class SseParser:
    """Incremental Server-Sent Events parser (the WHATWG rules we need).

    Feed raw bytes; get back the ``data`` of every complete event. Events end at a blank
    line; several ``data:`` lines join with newlines; comment lines (``:``) and other fields
    are ignored; CRLF and LF both end lines.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r" in buf:
            held = buf.endswith(b"\r")  # maybe the first half of a CRLF
            body = buf[:-1] if held else buf
            buf = body.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
        blocks = buf.split(b"\n\n")
        self._buf = blocks.pop()
        events = []
        for block in blocks:
            data = [line[6:] if line.startswith(b"data: ") else line[5:]
                    for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(data[0] if len(data) == 1 else b"\n".join(data))
        return events


_TEXT_KEYS = (b'"text":"', b'"content":"')


def _event_text_and_usage(payload: bytes) -> tuple[bool, int | None]:
    """Whether an OpenAI chunk carries output text, and its usage.completion_tokens.

    Compact JSON without usage (vLLM's token chunks) is read without a full parse.
    """
    if b'"usage"' not in payload:
        for key in _TEXT_KEYS:
            at = payload.find(key)
            if at >= 0:
                return payload[at + len(key):at + len(key) + 1] != b'"', None
    obj = json.loads(payload)
    usage = obj.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    for choice in obj.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return True, tokens
    return False, tokens


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord,
                       sent: float, clock: Callable[[], float]) -> None:
    parser, first, last, n, usage_tokens, done = SseParser(), None, None, 0, None, False
    async for chunk in resp.content.iter_any():
        now = clock()
        for payload in parser.feed(chunk):
            if payload == b"[DONE]":
                done = True
                continue
            has_text, tokens = _event_text_and_usage(payload)
            usage_tokens = tokens if tokens is not None else usage_tokens
            if has_text:
                n += 1
                first = now if first is None else first
                last = now
    rec.e2e = clock() - sent
    rec.output_tokens = usage_tokens if usage_tokens is not None else n
    if first is not None:
        rec.ttft = first - sent
        if n > 1 and last is not None:
            rec.tpot = (last - first) / (n - 1)
    if not done:
        rec.error = "truncated"


async def _read_unary(resp: aiohttp.ClientResponse, rec: RequestRecord, sent: float,
                      clock: Callable[[], float]) -> None:
    body = await resp.json(content_type=None)
    rec.e2e = rec.ttft = clock() - sent
    usage = body.get("usage") or {}
    rec.output_tokens = int(usage.get("completion_tokens", 0))
    if rec.output_tokens > 1:
        rec.tpot = None  # not observable without streaming


def _classify(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | ConnectionResetError | aiohttp.ClientOSError):
        return "reset"
    return type(exc).__name__


def note_error_answer(rec: RequestRecord, status: int, body: bytes,
                      headers: Mapping[str, str]) -> None:
    """A non-200 answer: a refusal for 429, else error ``http_<status>``; either way its
    OpenAI shape and Retry-After (:mod:`.refusals`)."""
    answer = read_error_answer(body, headers)
    rec.openai_error, rec.error_type, rec.error_code = (answer.openai_shaped, answer.error_type,
                                                        answer.error_code)
    rec.retry_after, rec.retry_after_s = answer.retry_after, answer.retry_after_s
    if status == REFUSAL_STATUS:
        rec.refused = True
    else:
        rec.error = f"http_{status}"


async def send_one(session: aiohttp.ClientSession, url: str, body: bytes, stream: bool,
                   rec: RequestRecord, clock: Callable[[], float],
                   headers: Mapping[str, str] | None = None) -> RequestRecord:
    """Send one request and fill in ``rec``; never raises (errors land in ``rec.error``,
    refusals in ``rec.refused``)."""
    sent = rec.sent_at = clock()
    try:
        async with session.post(url, data=body,
                                headers=headers or {"Content-Type": "application/json"}) as resp:
            rec.status = resp.status
            rec.server = resp.headers.get(SERVER_HEADER)
            if resp.status != 200:
                note_error_answer(rec, resp.status, await resp.read(), resp.headers)
                rec.e2e = clock() - sent
            elif stream:
                await _read_stream(resp, rec, sent, clock)
            else:
                await _read_unary(resp, rec, sent, clock)
    except Exception as exc:  # every failure is data for the report
        rec.error = _classify(exc)
        rec.e2e = clock() - sent
    return rec


def make_session(w: Workload, max_connections: int | None = None) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max_connections or w.max_connections,
                                     limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=w.timeout_s, sock_connect=10)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def run_load(targets: Sequence[str], w: Workload, *, rate: float | None = None,
                   duration: float | None = None, seed: int | None = None,
                   on_progress: Callable[[Progress], None] | None = None,
                   max_connections: int | None = None) -> RunResult:
    """Run ``w`` (optionally at another rate/duration/seed) against ``targets``.

    ``targets`` are base URLs (``http://host:port``); requests go to them in turn.
    """
    if not targets:
        raise ValueError("no targets")
    rate, duration = rate or w.rate, duration or w.duration_s
    schedule = build_schedule(w, rate=rate, duration=duration, seed=seed)
    urls = [t.rstrip("/") + endpoint_path(w) for t in targets]
    probe = LagProbe()
    probe_task = asyncio.create_task(probe.run())
    try:
        async with make_session(w, max_connections) as session:
            records, wall = await _drive(session, schedule, urls, w, on_progress)
    finally:
        probe_task.cancel()
        await asyncio.gather(probe_task, return_exceptions=True)
    return RunResult(records=records, offered_rate=rate, duration_s=duration, wall_s=wall,
                     targets=list(targets), started_unix=time.time() - wall,
                     extra={"client": probe.summary()})


class _Dispatcher:
    """Sends a schedule open-loop and collects the records as requests finish."""

    def __init__(self, session: aiohttp.ClientSession, w: Workload, total: int,
                 on_progress: Callable[[Progress], None] | None) -> None:
        self.session, self.w, self.on_progress = session, w, on_progress
        self.progress = Progress(total=total)
        self.pending: set[asyncio.Task[RequestRecord]] = set()
        self.records: list[RequestRecord] = []

    def _notify(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.progress)

    def _finished(self, task: asyncio.Task[RequestRecord]) -> None:
        self.pending.discard(task)
        if task.cancelled():
            return
        rec = task.result()
        self.records.append(rec)
        self.progress.done += 1
        self.progress.errors += rec.error is not None
        self.progress.refused += rec.refused
        self._notify()

    def send(self, p: PlannedRequest, url: str, clock: Callable[[], float]) -> None:
        rec = RequestRecord(p.index, p.cls, p.prompt_tokens, p.max_tokens, scheduled_at=p.at,
                            tenant=p.tenant)
        body = request_body(p, self.w)
        task = asyncio.create_task(send_one(self.session, url, body,
                                            request_streams(p, self.w), rec, clock,
                                            request_headers(p, self.w)))
        self.pending.add(task)
        task.add_done_callback(self._finished)
        self.progress.sent += 1
        self._notify()

    async def drain(self) -> None:
        if self.pending:
            await asyncio.wait(set(self.pending))

    async def cancel(self) -> None:
        for task in list(self.pending):
            task.cancel()
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


async def _drive(session: aiohttp.ClientSession, schedule: list[PlannedRequest],
                 urls: list[str], w: Workload,
                 on_progress: Callable[[Progress], None] | None
                 ) -> tuple[list[RequestRecord], float]:
    loop = asyncio.get_running_loop()
    dispatcher = _Dispatcher(session, w, len(schedule), on_progress)
    start = loop.time()
    try:
        for p, url in zip(schedule, itertools.cycle(urls), strict=False):
            delay = start + p.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            dispatcher.send(p, url, loop.time)
        await dispatcher.drain()
    finally:
        await dispatcher.cancel()
    records = sorted(dispatcher.records, key=lambda r: r.index)
    for rec in records:
        rec.sent_at -= start
    return records, loop.time() - start
