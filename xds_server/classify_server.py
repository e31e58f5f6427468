"""The intent classifier run by `trimtab serve` itself (``classifier.embedded``, the default).

When a pool enables ``intent_tiers``, `trimtab serve` starts the ext_proc service of
`xds_server.classify` on ``classifier.address`` as its own child process (``python -m
xds_server.classify_server``), so there is nothing else to deploy. A child, not a thread: a
tick's C calls (YAML, protobuf) hold the GIL, and a full garbage collection of trimtab's heap
stops every thread of its process; the child shares neither, so ticks, scrapes and pushes
never hold a classification (figures, child against thread, in docs/benchmarks.md: on the
shared 2-core test host the difference is within its noise).

Parent and child talk over the child's stdin/stdout, one JSON object a line: the parent sends
``{"limits": <classifier config>}`` (first: start; later: new rules from a reload), the child
answers ``{"listening": port}`` or ``{"error": reason}``, then ``{"applied": rules}`` per
update. The child exits when its stdin closes, so it never outlives trimtab (not even a
SIGKILLed one); it ignores SIGINT (a terminal's Ctrl-C reaches the whole process group, and
trimtab stops it in order).

* Start: a bind failure raises `CannotListen` naming ``classifier.address`` (`trimtab serve`
  exits 2 with that line).
* Reload (SIGHUP): new rules and bounds apply from the child's next body; a changed
  ``classifier.address`` while it runs is refused; a reload that turns tiers on starts it
  (refused if the address cannot be bound), one that turns them off (or sets ``embedded:
  false``) stops it.
* A child that dies is started again (after `RESTART_AFTER_S`); meanwhile Envoy fails open.
  `UP` is 1 while it serves, `RESTARTS` counts restarts. Its decisions are counted by the
  metrics of `xds_server.classify` inside the child: set ``classifier.metrics_address`` to
  serve them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
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
KEY = "classifier.address"


def embedded_limits(config: Config) -> ClassifierConfig | None:
    """The classifier `trimtab serve` must run for `config`, or None."""
    limits = config.classifier
    if limits is None or not limits.embedded or not classifier_used(config):
        return None
    return limits


def _line(limits: ClassifierConfig) -> bytes:
    return (json.dumps({"limits": limits.model_dump(mode="json")}) + "\n").encode()


class _Child:
    """One classifier process, from `start()` (blocking) to `stop()` (blocking)."""

    def __init__(self, limits: ClassifierConfig) -> None:
        self.address = limits.address
        self.port = 0
        self._first = limits
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._lock = threading.Lock()  # one request/answer exchange at a time

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
        answer = self._ask(self._first, START_TIMEOUT_S)
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

    def _ask(self, limits: ClassifierConfig, timeout: float) -> dict[str, Any] | None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return None
            try:
                self._proc.stdin.write(_line(limits))
                self._proc.stdin.flush()
                return self._answers.get(timeout=timeout)
            except (OSError, queue.Empty):
                return None

    def update(self, limits: ClassifierConfig) -> str | None:
        """None when the child applied `limits`, else why not."""
        answer = self._ask(limits, ANSWER_TIMEOUT_S)
        if answer is not None and "applied" in answer:
            return None
        return str((answer or {}).get("error", "the classifier did not answer"))

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

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
        self._watch = asyncio.create_task(self._restart_when_dead())
        log.info("classifier listening on %s (embedded, %d rules)", limits.address,
                 len(limits.rules))

    async def _restart_when_dead(self) -> None:
        while True:
            await asyncio.sleep(RESTART_AFTER_S)
            child, limits = self._child, self._limits
            if child is None or limits is None or child.alive():
                continue
            UP.set(0)
            log.error("the embedded classifier exited; starting it again (Envoy fails "
                      "open meanwhile)")
            await asyncio.to_thread(child.stop)
            fresh = _Child(limits)
            try:
                await asyncio.to_thread(fresh.start)
            except (CannotListen, ValueError) as exc:
                log.error("cannot start the embedded classifier again: %s", exc)
                continue
            if self._child is child:
                self._child = fresh
                RESTARTS.inc()
                UP.set(1)
            else:  # closed or replaced meanwhile
                await asyncio.to_thread(fresh.stop)

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


async def _serve_child(limits: ClassifierConfig) -> int:
    from xds_server.classify import ExtProcService, build_classifier, build_server, settle_heap

    try:
        service = ExtProcService(build_classifier(limits), limits)
    except ValueError as exc:  # classifier.learned
        _say({"error": str(exc), "key": "classifier.learned"})
        return 2
    try:
        server, port = build_server(service, limits.address)
        await server.start()
    except (OSError, RuntimeError) as exc:  # grpcio: RuntimeError
        _say({"error": cannot_listen(limits.address, exc).reason})
        return 1
    settle_heap()
    _say({"listening": port})
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, done.set)

    def apply(new: ClassifierConfig) -> None:
        try:
            service.update(build_classifier(new), new)
        except ValueError as exc:  # the old classifier keeps answering
            _say({"error": str(exc), "key": "classifier.learned"})
            return
        _say({"applied": len(new.rules)})

    def read() -> None:  # the parent's updates; EOF: the parent is gone or done with us
        for raw in sys.stdin:
            new = ClassifierConfig.model_validate(json.loads(raw)["limits"])
            loop.call_soon_threadsafe(apply, new)
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
    limits = ClassifierConfig.model_validate(json.loads(first)["limits"])
    if limits.metrics_address is not None:
        where = parse_host_port(limits.metrics_address)
        try:
            start_http_server(where.port, where.host)
        except OSError as exc:
            log.error("classifier.metrics_address %s: %s; no metrics page",
                      limits.metrics_address, reason_for(exc))
    return asyncio.run(_serve_child(limits))


if __name__ == "__main__":
    sys.exit(child_main())
