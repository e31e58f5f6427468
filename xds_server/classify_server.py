"""The intent classifier run by `trimtab serve` itself (``classifier.embedded``, the default).

When a pool enables ``intent_tiers``, `trimtab serve` starts the ext_proc service of
`xds_server.classify` on ``classifier.address`` as its own child process (``python -m
xds_server.classify_server``), so there is nothing else to deploy. A child, not a thread: a
tick's C calls (YAML, protobuf) hold the GIL, and a full garbage collection of trimtab's heap
stops every thread of its process; the child shares neither, so ticks, scrapes and pushes
never hold a classification (figures, child against thread, in docs/benchmarks.md: on the
shared 2-core test host the difference is within its noise).

Parent and child talk over the child's stdin/stdout, one JSON object a line, each carrying
the ``id`` of the parent's message it answers (a late answer to an abandoned question is
dropped): the parent sends ``{"limits": <classifier config>}`` (first: start; later: new rules
from a reload), the child answers ``{"listening": port}`` or ``{"error": reason}``, then
``{"applied": rules}`` per update; ``{"ping": true}`` is answered ``{"pong": true}`` from the
child's event loop, the loop that serves Envoy. The child exits when its stdin closes, so it never outlives trimtab (not even a
SIGKILLed one); it ignores SIGINT (a terminal's Ctrl-C reaches the whole process group, and
trimtab stops it in order).

* Start: a bind failure raises `CannotListen` naming ``classifier.address`` (`trimtab serve`
  exits 2 with that line).
* Reload (SIGHUP): new rules and bounds apply from the child's next body; a changed
  ``classifier.address`` while it runs is refused; a reload that turns tiers on starts it
  (refused if the address cannot be bound), one that turns them off (or sets ``embedded:
  false``) stops it.
* Watchdog: every `HEALTH_EVERY_S` the parent pings the child; a child that has exited, or
  has not answered within `HEALTH_DEADLINE_S` (stopped, or its loop stuck), is logged once,
  `UP` goes to 0, it is killed (SIGKILL: its port closes, so Envoy's connections are refused
  and it fails open at once instead of waiting ``message_timeout_ms`` per request) and a new
  one is started after `RESTART_AFTER_S`, doubling per consecutive failure up to
  `MAX_RESTART_AFTER_S` (back to the first once a child has answered for `STABLE_AFTER_S`).
  `UP` is 1 while it serves and answers, `RESTARTS` counts restarts. Its decisions are counted by the
  metrics of `xds_server.classify` inside the child: set ``classifier.metrics_address`` to
  serve them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from prometheus_client import Counter, Gauge, start_http_server

from xds_server.config.addresses import parse_host_port
from xds_server.config.schema import ClassifierConfig, Config
from xds_server.envoy.request_features import classifier_used
from xds_server.listen import CannotListen, cannot_listen, check_bindable, reason_for

log = logging.getLogger("trimtab.classify")

UP = Gauge("trimtab_classifier_embedded_up",
           "1 while the classifier trimtab serve runs itself is serving")
RESTARTS = Counter("trimtab_classifier_embedded_restarts_total",
                   "Times trimtab serve started its classifier again after it died")
START_TIMEOUT_S = 20.0  # the child imports grpc and the Envoy protos first
ANSWER_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
RESTART_AFTER_S = 1.0
MAX_RESTART_AFTER_S = 30.0
STABLE_AFTER_S = 30.0
HEALTH_EVERY_S = 1.0
HEALTH_DEADLINE_S = 1.0
KEY = "classifier.address"


def embedded_limits(config: Config) -> ClassifierConfig | None:
    """The classifier `trimtab serve` must run for `config`, or None."""
    limits = config.classifier
    if limits is None or not limits.embedded or not classifier_used(config):
        return None
    return limits


def _limits_message(limits: ClassifierConfig) -> dict[str, Any]:
    return {"limits": limits.model_dump(mode="json")}


class _Child:
    """One classifier process, from `start()` (blocking) to `stop()` (blocking)."""

    def __init__(self, limits: ClassifierConfig) -> None:
        self.address = limits.address
        self.port = 0
        self._first = limits
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()  # one request/answer exchange at a time
        self._ids = itertools.count(1)
        self._asked_at: float | None = None  # when the exchange in flight began

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Spawn, bind and serve; raise CannotListen when `address` cannot be bound."""
        try:
            check_bindable(self.address)
        except CannotListen as exc:
            raise CannotListen(f"{KEY} {self.address}", exc.reason) from None
        self._proc = subprocess.Popen([sys.executable, "-m", "xds_server.classify_server"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                         name="trimtab-classifier-answers").start()
        answer = self._ask(_limits_message(self._first), START_TIMEOUT_S)
        if answer is None or "listening" not in answer:
            self.stop()
            reason = (answer or {}).get("error", "the classifier did not start")
            if (answer or {}).get("key") == "classifier.learned":
                raise ValueError(reason)  # the operator's plug-in: `trimtab serve` exits 2
            raise CannotListen(f"{KEY} {self.address}", str(reason))
        self.port = int(answer["listening"])

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        for raw in stream:
            with contextlib.suppress(ValueError):
                self._answers.put(json.loads(raw))
        self._answers.put(None)  # the child is gone

    def _ask(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The child's answer to `message` within `timeout` of sending it, or None."""
        with self._lock:
            return self._exchange(message, timeout)

    def _exchange(self, message: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return None
        ident = next(self._ids)
        self._asked_at = time.monotonic()
        try:
            proc.stdin.write((json.dumps({**message, "id": ident}) + "\n").encode())
            proc.stdin.flush()
            return self._answer_to(ident, self._asked_at + timeout)
        except (OSError, ValueError):  # ValueError: stdin closed by kill() meanwhile
            return None
        finally:
            self._asked_at = None

    def _answer_to(self, ident: int, deadline: float) -> dict[str, Any] | None:
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if answer is None:
                self._answers.put(None)  # gone: every later question learns it at once
                return None
            if answer.get("id") == ident:
                return answer

    def update(self, limits: ClassifierConfig) -> str | None:
        """None when the child applied `limits`, else why not."""
        answer = self._ask(_limits_message(limits), ANSWER_TIMEOUT_S)
        if answer is not None and "applied" in answer:
            return None
        return str((answer or {}).get("error", "the classifier did not answer"))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def health(self, deadline: float) -> str | None:
        """None while the child serves; else what is wrong with it, in words."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            status = proc.returncode if proc is not None else None
            return f"exited (status {status})"
        if not self._lock.acquire(blocking=False):  # an update is in flight
            asked_at, limit = self._asked_at, ANSWER_TIMEOUT_S + deadline
            if asked_at is not None and time.monotonic() - asked_at > limit:
                return f"did not take an update within {limit:g} s"
            return None  # it reports its own failure in time
        try:
            answer = self._exchange({"ping": True}, deadline)
        finally:
            self._lock.release()
        if answer is not None and answer.get("pong"):
            return None
        return f"did not answer a health check within {deadline:g} s"

    def kill(self) -> None:
        """SIGKILL (a stopped child too) and reap at once: its port closes now."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        proc.wait()

    def stop(self) -> None:
        """Close its stdin (it exits), then SIGTERM, then SIGKILL; always reaped."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        for step in (None, signal.SIGTERM, signal.SIGKILL):
            if step is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(step)
            try:
                proc.wait(STOP_TIMEOUT_S)
                break
            except subprocess.TimeoutExpired:
                continue


@dataclass
class _Backoff:
    """How long to wait before the next start: `RESTART_AFTER_S`, doubled per consecutive
    failure up to `MAX_RESTART_AFTER_S`; failures are forgotten once a child has answered
    every health check for `STABLE_AFTER_S`."""

    failures: int = 0
    healthy_since: float | None = None

    def next_wait(self) -> float:
        wait = min(RESTART_AFTER_S * 2 ** min(self.failures, 16), MAX_RESTART_AFTER_S)
        self.failures += 1
        self.healthy_since = None
        return wait

    def healthy(self, now: float) -> None:
        if self.healthy_since is None:
            self.healthy_since = now
        elif now - self.healthy_since >= STABLE_AFTER_S:
            self.failures = 0


async def _started(limits: ClassifierConfig) -> _Child:
    """A new child, serving; a cancellation while it starts stops it (no orphan)."""
    child = _Child(limits)
    starting = asyncio.ensure_future(asyncio.to_thread(child.start))
    try:
        await asyncio.shield(starting)
    except asyncio.CancelledError:
        await asyncio.gather(starting, return_exceptions=True)
        await asyncio.to_thread(child.stop)
        raise
    return child


class EmbeddedClassifier:
    """`trimtab serve`'s classifier: runs while the config wants one (see `embedded_limits`)."""

    def __init__(self) -> None:
        self._child: _Child | None = None
        self._limits: ClassifierConfig | None = None
        self._watch: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._child is not None

    @property
    def port(self) -> int | None:
        return self._child.port if self._child is not None else None

    async def start(self, config: Config) -> None:
        limits = embedded_limits(config)
        if limits is None or self._child is not None:
            return
        child = _Child(limits)
        await asyncio.to_thread(child.start)
        self._child, self._limits = child, limits
        UP.set(1)
        self._watch = asyncio.create_task(self._watchdog())
        log.info("classifier listening on %s (embedded, %d rules)", limits.address,
                 len(limits.rules))

    async def _watchdog(self) -> None:
        backoff = _Backoff()
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            child = self._child
            if child is None:
                continue
            problem = await asyncio.to_thread(child.health, HEALTH_DEADLINE_S)
            if problem is None:
                backoff.healthy(time.monotonic())
                continue
            UP.set(0)
            wait = backoff.next_wait()
            log.error("the embedded classifier (pid %s) %s: killed, starting a new one in "
                      "%.1f s (Envoy fails open meanwhile)", child.pid, problem, wait)
            await asyncio.to_thread(child.kill)
            await self._replace(child, wait, backoff)

    async def _replace(self, old: _Child, wait: float, backoff: _Backoff) -> None:
        """Start a child in place of `old` (stopped), trying again with backoff; gives up
        when `old` is no longer the current child (closed or replaced meanwhile)."""
        while self._child is old and self._limits is not None:
            await asyncio.sleep(wait)
            try:
                fresh = await _started(self._limits)
            except (CannotListen, ValueError) as exc:
                wait = backoff.next_wait()
                log.error("cannot start the embedded classifier again: %s; next try in "
                          "%.1f s", exc, wait)
                continue
            if self._child is not old:
                await asyncio.to_thread(fresh.stop)
                return
            self._child = fresh
            RESTARTS.inc()
            UP.set(1)
            log.info("the embedded classifier serves again (pid %s)", fresh.pid)
            return

    async def reload(self, config: Config) -> list[tuple[str, str]]:
        """Apply `config` to the classifier, or change nothing and return why (key, reason)."""
        limits = embedded_limits(config)
        child = self._child
        if child is None:
            try:
                await self.start(config)
            except CannotListen as exc:
                return [(KEY, f"cannot start the embedded classifier: {exc.reason}")]
            except ValueError as exc:  # classifier.learned
                return [("classifier.learned", str(exc).partition(": ")[2])]
            return []
        if limits is None:
            await self.close()
            log.info("embedded classifier stopped: the new config sends no request to it")
            return []
        if limits.address != child.address:
            return [(KEY, f"cannot change while the embedded classifier listens on "
                          f"{child.address}; restart trimtab to apply it")]
        problem = await asyncio.to_thread(child.update, limits)
        if problem is not None and problem.startswith("classifier.learned"):
            return [("classifier.learned", problem.partition(": ")[2])]  # the old one answers
        self._limits = limits  # what a restart uses
        if problem is None:
            log.info("embedded classifier: %d rules applied", len(limits.rules))
        else:
            log.error("the embedded classifier did not confirm the new rules (%s); it is "
                      "started again with them if it died", problem)
        return []

    async def close(self) -> None:
        UP.set(0)  # first: it stops serving now
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        child, self._child = self._child, None
        if child is not None:
            await asyncio.to_thread(child.stop)


# -- the child process ------------------------------------------------------------------------


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def _serve_child(limits: ClassifierConfig, first_id: Any) -> int:
    from xds_server.classify import ExtProcService, build_classifier, build_server, settle_heap

    try:
        service = ExtProcService(build_classifier(limits), limits)
    except ValueError as exc:  # classifier.learned
        _say({"error": str(exc), "key": "classifier.learned", "id": first_id})
        return 2
    try:
        server, port = build_server(service, limits.address)
        await server.start()
    except (OSError, RuntimeError) as exc:  # grpcio: RuntimeError
        _say({"error": cannot_listen(limits.address, exc).reason, "id": first_id})
        return 1
    settle_heap()
    _say({"listening": port, "id": first_id})
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)

    def apply(new: ClassifierConfig, ident: Any) -> None:
        try:
            service.update(build_classifier(new), new)
        except ValueError as exc:  # the old classifier keeps answering
            _say({"error": str(exc), "key": "classifier.learned", "id": ident})
            return
        _say({"applied": len(new.rules), "id": ident})

    def read() -> None:  # the parent's messages; EOF: the parent is gone or done with us
        for raw in sys.stdin:
            message = json.loads(raw)
            ident = message.get("id")
            if message.get("ping"):  # answered by the loop that serves Envoy
                loop.call_soon_threadsafe(_say, {"pong": True, "id": ident})
                continue
            new = ClassifierConfig.model_validate(message["limits"])
            loop.call_soon_threadsafe(apply, new, ident)
        loop.call_soon_threadsafe(done.set)

    threading.Thread(target=read, daemon=True, name="parent").start()
    await done.wait()
    await server.stop(1.0)
    return 0


def child_main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # trimtab stops us (stdin closes)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s trimtab.classify: %(message)s")
    first = sys.stdin.readline()
    if not first:
        return 0
    message = json.loads(first)
    limits = ClassifierConfig.model_validate(message["limits"])
    if limits.metrics_address is not None:
        where = parse_host_port(limits.metrics_address)
        try:
            start_http_server(where.port, where.host)
        except OSError as exc:
            log.error("classifier.metrics_address %s: %s; no metrics page",
                      limits.metrics_address, reason_for(exc))
    return asyncio.run(_serve_child(limits, message.get("id")))


if __name__ == "__main__":
    sys.exit(child_main())
