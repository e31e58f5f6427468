"""Convergence: from the telemetry read that changed an endpoint's weight to Envoy's ACK of it.

The controller tells the cache when it read the telemetry a snapshot was built from
(``SnapshotCache.set_snapshot(snapshot, read_at)``); every ClusterLoadAssignment that the
published snapshot records as changed (``Snapshot.changes``) is stamped with that time. A stream records which EDS resource versions each of its
responses carried (:class:`StreamConvergence`), and when Envoy ACKs that response the delay
from the oldest stamp it carried to the ACK is observed once in ``trimtab_convergence_seconds``
(the CLAs of one tick share one stamp, so per resource would only repeat the figure). Config-only publishes (a reload) carry no telemetry time and
are not stamped. The tracker is bounded: it keeps the stamps of the latest ``max_versions``
resource versions, and a stream keeps only its unacknowledged EDS responses (one in flight per
type, so a handful).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from xds_server.admin import metrics
from xds_server.xds import type_urls
from xds_server.xds.snapshot import Resource, Snapshot

EDS = type_urls.ENDPOINT
MAX_VERSIONS = 65536
MAX_PENDING = 8


@dataclass
class Convergence:
    """Stamps of EDS resource versions: (name, version) -> when its telemetry was read."""

    max_versions: int = MAX_VERSIONS
    stamps: OrderedDict[tuple[str, str], float] = field(default_factory=OrderedDict)

    def published(self, snapshot: Snapshot, read_at: float | None) -> int:
        """Stamp the EDS resources that changed in ``snapshot`` (a published one, which
        records its changes; every one if it is the first); returns how many."""
        if read_at is None:
            return 0
        have = snapshot.of_type(EDS)
        change = snapshot.changes.get(EDS)
        names = have.keys() if change is None else change.names & have.keys()
        for name in names:
            key = (name, have[name].version)
            self.stamps[key] = read_at
            self.stamps.move_to_end(key)
        while len(self.stamps) > self.max_versions:
            self.stamps.popitem(last=False)
        return len(names)

    def stamp_of(self, name: str, version: str) -> float | None:
        return self.stamps.get((name, version))


@dataclass
class StreamConvergence:
    """One stream's EDS responses awaiting an ACK: nonce -> (name, version) pairs."""

    tracker: Convergence
    api: str
    pending: OrderedDict[str, tuple[tuple[str, str], ...]] = field(default_factory=OrderedDict)

    def sent(self, type_url: str, nonce: str, resources: Iterable[Resource]) -> None:
        if type_url != EDS:
            return
        carried = tuple((r.name, r.version) for r in resources)
        if not carried:
            return
        self.pending[nonce] = carried
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    def acked(self, type_url: str, nonce: str, now: float) -> list[float]:
        """The delays this ACK completes (observed in the histogram); [] if none."""
        if type_url != EDS:
            return []
        carried = self.pending.pop(nonce, ())
        delays = []
        for name, version in carried:
            stamp = self.tracker.stamp_of(name, version)
            if stamp is not None and now >= stamp:
                delays.append(now - stamp)
        if delays:  # one observation per ACK: 1,000 streams x 100 CLAs stay 1,000 a tick
            metrics.CONVERGENCE_SECONDS.labels(api=self.api).observe(max(delays))
        return delays

    def nacked(self, nonce: str) -> None:
        self.pending.pop(nonce, None)
