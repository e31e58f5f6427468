"""Where rollout state lives: the state-store interface and its two backends.

* :class:`FileStateStore` — the atomically written JSON file (embedded mode, ``make demo``).
* :class:`ConfigMapStateStore` — one ConfigMap in the API server (replicas on Kubernetes),
  key ``rollouts.json`` holding exactly the file's JSON (``rollout.to_json``), checked field
  by field on every read like the file. Writes are optimistic: a replace carries the
  ``resourceVersion`` that was read, and a 409 Conflict raises :class:`StateConflict` so the
  caller re-reads and re-decides; nothing is ever written over a state it did not read.

Both are synchronous (the ``kubernetes`` client is); callers on the event loop run them with
``asyncio.to_thread``. Every API call has a timeout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from xds_server.control.leader import API_ERRORS, HTTP_CONFLICT, HTTP_NOT_FOUND, describe_error
from xds_server.control.rollouts import machine as rollout
from xds_server.control.rollouts.machine import RolloutState, RolloutStateError

STATE_KEY = "rollouts.json"
WRITER_ANNOTATION = "trimtab.dev/written-by"


class StateStoreError(RuntimeError):
    """The state could not be read or written (the API or the disk; not the caller's)."""


class StateConflict(StateStoreError):
    """Someone wrote the state after we read it: re-read, re-decide, try again."""


@dataclass(frozen=True)
class StoredState:
    states: dict[str, RolloutState]
    version: str | None  # the backend's version of what was read (None: absent / file)


class StateStore(Protocol):
    def load(self) -> StoredState:
        """The current state. Raises StateStoreError (unreachable) or RolloutStateError
        (present but corrupt: never guessed)."""

    def save(self, states: Mapping[str, RolloutState], version: str | None) -> str | None:
        """Write ``states`` over the version that was read; returns the new version.
        Raises StateConflict when that version is no longer current."""


@dataclass
class FileStateStore:
    path: Path

    def load(self) -> StoredState:
        return StoredState(rollout.load_state(self.path), None)

    def save(self, states: Mapping[str, RolloutState], version: str | None) -> str | None:
        try:
            rollout.save_state(self.path, states)
        except OSError as exc:
            raise StateStoreError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        return None


@dataclass
class ConfigMapStateStore:
    api_client: k8s_client.ApiClient
    namespace: str
    name: str
    writer: str  # this replica's identity, recorded in an annotation
    request_timeout: float = 2.0
    _api: k8s_client.CoreV1Api = field(init=False, repr=False)
    # the metadata last read, by resourceVersion: a replace keeps its labels and annotations
    # (kubectl's last-applied, kustomize's labels), adding only the writer annotation
    _read_metadata: tuple[str | None, dict[str, Any]] = field(default=(None, {}), init=False,
                                                              repr=False)

    def __post_init__(self) -> None:
        self._api = k8s_client.CoreV1Api(self.api_client)

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    def load(self) -> StoredState:
        try:
            obj = self._call(self._api.read_namespaced_config_map, self.name, self.namespace)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                return StoredState({}, None)
            raise StateStoreError(f"cannot read {self.where}: {describe_error(exc)}") from None
        except API_ERRORS as exc:
            raise StateStoreError(f"cannot read {self.where}: {describe_error(exc)}") from None
        version = (obj.get("metadata") or {}).get("resourceVersion")
        self._read_metadata = (version, dict(obj.get("metadata") or {}))
        text = (obj.get("data") or {}).get(STATE_KEY)
        if text is None:
            return StoredState({}, version)
        try:
            return StoredState(rollout.from_json(text), version)
        except RolloutStateError as exc:
            raise RolloutStateError(f"{self.where} key {STATE_KEY}: {exc} (fix or delete "
                                    f"it; trimtab will not guess a rollout's state)") from None

    def save(self, states: Mapping[str, RolloutState], version: str | None) -> str | None:
        read_version, read = self._read_metadata
        kept = read if version is not None and read_version == version else {}
        metadata: dict[str, Any] = {
            "name": self.name, "namespace": self.namespace,
            "labels": kept.get("labels") or {"app.kubernetes.io/name": "trimtab"},
            "annotations": {**(kept.get("annotations") or {}), WRITER_ANNOTATION: self.writer}}
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                "data": {STATE_KEY: rollout.to_json(states)}}
        try:
            if version is None:  # absent when read: create (409 AlreadyExists: lost a race)
                written = self._call(self._api.create_namespaced_config_map, self.namespace,
                                     body)
            else:
                metadata["resourceVersion"] = version
                written = self._call(self._api.replace_namespaced_config_map, self.name,
                                     self.namespace, body)
        except ApiException as exc:
            if exc.status == HTTP_CONFLICT:
                raise StateConflict(f"{self.where} changed since it was read "
                                    f"(resourceVersion {version})") from None
            raise StateStoreError(f"cannot write {self.where}: {describe_error(exc)}") from None
        except API_ERRORS as exc:
            raise StateStoreError(f"cannot write {self.where}: {describe_error(exc)}") from None
        return (written.get("metadata") or {}).get("resourceVersion")

    def _call(self, method: Any, *args: Any) -> dict[str, Any]:
        response = method(*args, _preload_content=False,
                          _request_timeout=(self.request_timeout, self.request_timeout))
        body = json.loads(response.data)
        if not isinstance(body, dict):
            raise ValueError("the API answered with a non-object")
        return body
