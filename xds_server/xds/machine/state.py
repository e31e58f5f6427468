"""Per-type stream state (`TypeState`) and the versions a stream must not be sent again
(`Rejections`). Owned by one stream's machine; never shared between streams."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from xds_server.xds.machine.limits import MAX_REJECTED_VERSIONS
from xds_server.xds.snapshot import Resource, Snapshot

WILDCARD = "*"


def _remember(versions: tuple[str, ...], version: str) -> tuple[str, ...]:
    """`versions` plus `version`, the oldest forgotten beyond MAX_REJECTED_VERSIONS."""
    if version in versions:
        return versions
    return (*versions, version)[-MAX_REJECTED_VERSIONS:]


@dataclass
class Rejections:
    """Versions one stream must not be sent again, per type: the ones it NACKed, and the ones
    withheld from it as too large. Never shared between streams: what one client rejects (or
    claims to) cannot suppress another's config. Bounded: at most MAX_REJECTED_VERSIONS per
    resource name (names come from our own snapshots) and per type for whole states."""

    resources: dict[str, dict[str, tuple[str, ...]]] = field(default_factory=dict)  # type -> name -> versions
    states: dict[str, tuple[str, ...]] = field(default_factory=dict)  # type -> whole-state versions

    def resource_rejected(self, type_url: str, name: str, version: str) -> bool:
        return version in self.resources.get(type_url, {}).get(name, ())

    def state_rejected(self, type_url: str, version: str) -> bool:
        return version in self.states.get(type_url, ())

    def of_type(self, type_url: str) -> Mapping[str, tuple[str, ...]]:
        """name -> rejected versions, for `type_url` (read-only use)."""
        return self.resources.get(type_url, {})

    def record(self, type_url: str, rejected: Mapping[str, str], state_version: str | None) -> None:
        by_name = self.resources.setdefault(type_url, {})
        for name, version in rejected.items():
            by_name[name] = _remember(by_name.get(name, ()), version)
        if state_version is not None:
            self.states[type_url] = _remember(self.states.get(type_url, ()), state_version)


@dataclass
class TypeState:
    type_url: str
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    name_bytes: int = 0  # UTF-8 bytes of `names`, charged to the stream's subscription budget
    sent: dict[str, str] = field(default_factory=dict)  # name -> version the client was sent/holds
    sent_state: str | None = None  # SotW whole-state version last sent
    pending_nonce: str | None = None  # awaiting ACK/NACK
    pending: dict[str, str] = field(default_factory=dict)
    pending_state: str | None = None
    pending_version: str = ""  # the version the pending response carried
    last_nonce: str = ""
    force: bool = False  # the client needs an answer even if nothing changed
    acked_version: str = ""
    # The snapshot's version of this type when it was last evaluated; None: evaluate in full.
    # Reset whenever the subscription or `sent` changes other than by an evaluation.
    evaluated: str | None = None
    more: bool = False  # the last response was a part: more of that push is still to be sent
    # `names` among the snapshot's names of this type, and the (names, snapshot names) objects
    # it was computed from: the memo key of `Snapshot.subset`, never larger than the snapshot.
    _present: frozenset[str] = field(default=frozenset(), repr=False)
    _present_basis: tuple[frozenset[str], frozenset[str]] | None = field(default=None, repr=False)

    def present(self, snapshot: Snapshot) -> frozenset[str]:
        """The subscribed names the snapshot has (recomputed only when either side changed)."""
        have = snapshot.names_of(self.type_url)
        basis = self._present_basis
        if basis is None or basis[0] is not self.names or basis[1] is not have:
            self._present = self.names & have
            self._present_basis = (self.names, have)
        return self._present

    def wanted(self, snapshot: Snapshot) -> Mapping[str, Resource]:
        """The subscribed resources, in name order (shared: do not modify)."""
        if self.wildcard:
            return snapshot.of_type(self.type_url)
        return snapshot.subset(self.type_url, self.present(snapshot))[0]

    def wanted_version(self, snapshot: Snapshot) -> str:
        """`type_version(self.wanted(snapshot))`, without computing it per stream."""
        if self.wildcard:
            return snapshot.type_version_of(self.type_url)
        return snapshot.subset(self.type_url, self.present(snapshot))[1]

    def up_to_date(self, snapshot: Snapshot) -> bool:
        """Evaluating now would give what the last evaluation gave: nothing to send."""
        return not self.force and self.evaluated == snapshot.type_version_of(self.type_url)

    def changed_names(self, snapshot: Snapshot) -> frozenset[str] | None:
        """The names that changed since the last evaluation, or None if unknown (then every
        wanted resource must be looked at)."""
        if self.force or self.evaluated is None:
            return None
        change = snapshot.changes.get(self.type_url)
        if change is None or change.since != self.evaluated:
            return None
        return change.names

    def wanted_changes(self, snapshot: Snapshot) -> Iterable[tuple[str, Resource]]:
        """The wanted resources whose version may differ from `sent`, in name order."""
        names = self.changed_names(snapshot)
        if names is None:
            return self.wanted(snapshot).items()
        have = snapshot.of_type(self.type_url)
        return [(name, have[name]) for name in sorted(names)
                if name in have and (self.wildcard or name in self.names)]
