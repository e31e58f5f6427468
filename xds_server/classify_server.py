"""The intent classifier inside `trimtab serve` (``classifier.embedded``, the default).

When a pool enables ``intent_tiers``, `trimtab serve` runs the ext_proc service of
`xds_server.classify` on ``classifier.address`` itself, so there is no second process to
deploy. The service has its own thread and its own event loop: a tick, a scrape or an xDS push
on the main loop never delays a classification (only the GIL is shared).

* Start: a bind failure raises `CannotListen` naming ``classifier.address`` (`trimtab serve`
  exits 2 with that line).
* Reload (SIGHUP): new rules and bounds apply to the running service from the next body; a
  changed ``classifier.address`` while it runs is refused (restart to apply it); a reload that
  turns tiers on starts it (refused if the address cannot be bound), one that turns them off
  (or sets ``embedded: false``) stops it.
* `EMBEDDED_UP` is 1 while it serves. Its decisions are counted by the metrics of
  `xds_server.classify` on trimtab's own ``/metrics``; Envoy counts the fail-open cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import grpc
from prometheus_client import Gauge

from xds_server.classify import ExtProcService, RulesClassifier, build_server
from xds_server.config.schema import ClassifierConfig, Config
from xds_server.envoy.request_features import classifier_used
from xds_server.listen import CannotListen, cannot_listen, check_bindable

log = logging.getLogger("trimtab.classify")

EMBEDDED_UP = Gauge("trimtab_classifier_embedded_up",
                    "1 while trimtab serve runs the intent classifier itself")
START_TIMEOUT_S = 10.0
STOP_GRACE_S = 1.0
KEY = "classifier.address"


def embedded_limits(config: Config) -> ClassifierConfig | None:
    """The classifier `trimtab serve` must run for `config`, or None."""
    limits = config.classifier
    if limits is None or not limits.embedded or not classifier_used(config):
        return None
    return limits


class _Runner:
    """One gRPC server on its own thread and event loop, from `start()` to `stop()`."""

    def __init__(self, limits: ClassifierConfig) -> None:
        self.address = limits.address
        self.service = ExtProcService(RulesClassifier(limits.rules), limits)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="trimtab-classifier",
                                        daemon=True)

    def start(self) -> None:
        """Bind and serve; raise CannotListen when `address` cannot be bound."""
        try:
            check_bindable(self.address)
        except CannotListen as exc:
            raise CannotListen(f"{KEY} {self.address}", exc.reason) from None
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            self.stop()
            raise CannotListen(f"{KEY} {self.address}", "the classifier did not start")
        if self._error is not None:
            self._thread.join(START_TIMEOUT_S)
            found = cannot_listen(self.address, self._error)
            raise CannotListen(f"{KEY} {self.address}", found.reason)

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(loop))
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._started.is_set():
                self._error = exc
            else:
                log.exception("the embedded classifier stopped")
        finally:
            EMBEDDED_UP.set(0)
            self._started.set()
            loop.close()

    async def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        server: grpc.aio.Server | None = None
        stop = asyncio.Event()
        try:
            server, self.port = build_server(self.service, self.address)
            await server.start()
            self._loop, self._stop = loop, stop
            EMBEDDED_UP.set(1)
            self._started.set()
            await stop.wait()
        finally:
            if server is not None:
                await server.stop(STOP_GRACE_S)

    def stop(self) -> None:
        """Stop serving and join the thread (blocking: call it off the main loop)."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(START_TIMEOUT_S + STOP_GRACE_S)


class EmbeddedClassifier:
    """`trimtab serve`'s classifier: runs while the config wants one (see `embedded_limits`)."""

    def __init__(self) -> None:
        self._runner: _Runner | None = None

    @property
    def running(self) -> bool:
        return self._runner is not None

    @property
    def port(self) -> int | None:
        return self._runner.port if self._runner is not None else None

    async def start(self, config: Config) -> None:
        limits = embedded_limits(config)
        if limits is not None and self._runner is None:
            runner = _Runner(limits)
            await asyncio.to_thread(runner.start)
            self._runner = runner
            log.info("classifier listening on %s (embedded, %d rules)", limits.address,
                     len(limits.rules))

    async def reload(self, config: Config) -> list[tuple[str, str]]:
        """Apply `config` to the classifier, or change nothing and return why (key, reason)."""
        limits = embedded_limits(config)
        runner = self._runner
        if runner is None:
            try:
                await self.start(config)
            except CannotListen as exc:
                return [(KEY, f"cannot start the embedded classifier: {exc.reason}")]
            return []
        if limits is None:
            await self.close()
            log.info("embedded classifier stopped: no pool of the new config takes the hop "
                     "to it")
            return []
        if limits.address != runner.address:
            return [(KEY, f"cannot change while the embedded classifier listens on "
                          f"{runner.address}; restart trimtab to apply it")]
        runner.service.update(RulesClassifier(limits.rules), limits)
        log.info("embedded classifier: %d rules applied", len(limits.rules))
        return []

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await asyncio.to_thread(runner.stop)
