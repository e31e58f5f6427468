"""The xDS stream as a sans-IO state machine (SotW and Delta).

Requests go in with `receive()`, which returns events (ACK, NACK, stale nonce, ...). Given the
current snapshot, `responses()` returns what must be sent now. No I/O, no clocks, no gRPC: the
transport only pumps messages in and out.

Flow control: at most one response per type is in flight. Until the client ACKs or NACKs it,
newer snapshots for that type wait, and are coalesced to the latest when the reply arrives.

NACKs: the versions a stream rejected are remembered *by that stream* (never by node id, which
any client can claim), and never sent on it again; the next *different* version is. A new
stream starts with no NACK memory and gets the current state, so a version is NACKed at most
once per stream. For SotW Cluster/Listener (whole-state types) the rejected unit is the whole
set; for every other case it is the individual resource version.

Limits (`StreamLimits`): a request subscribing to more than `max_resource_names` names of one
type, holding more than `max_subscription_bytes` of names and initial_resource_versions in
all, or requesting more than `max_types` types ends the stream (`ResourceLimitExceeded`, the
peer's fault); so does a peer string over its bound (`FieldLimits`: node id, cluster,
locality, user agent, metadata, the node, resource names, type URL, version, nonce;
`FieldTooLarge`), checked before anything of the request is kept. A NACK's error text is kept
truncated to `FieldLimits.error_detail`, never refused. No response is larger than
`max_response_bytes` less `RESPONSE_HEADROOM`: SotW EDS/RDS and every Delta type are split
into several responses ("parts"), sent one at a time under the same flow control; SotW
CDS/LDS must carry the whole state in one response, so one that does not fit is withheld, as is
a single resource that does not fit (`Withheld` notices, our fault).

Cost per wake: a type is evaluated only when the snapshot's version of it differs from the one
it was last evaluated at (or its subscription changed, or an answer is forced); evaluating it
then looks only at the resources that changed since, when the snapshot records them (see
`Snapshot.changes`). A new snapshot that changed only EDS thus costs every stream one EDS
evaluation over the changed CLAs, and the ACKs that follow cost nothing.

The machines live in `xds_server.xds.machine`, one concern per module: `limits`
(`StreamLimits`, `FieldLimits`, the errors), `bounds` (checking peer strings), `events` (what they return), `state` (`TypeState`, `Rejections`),
`base` (what both APIs share: nonces, packing, flow control), `sotw` and `delta`. This module is
their public face: import the names below from here.
"""

from __future__ import annotations

from xds_server.xds.machine.base import part_version
from xds_server.xds.machine.delta import DeltaStream
from xds_server.xds.machine.events import (
    Ack,
    Event,
    Nack,
    Response,
    StaleNonce,
    Subscription,
    Withheld,
)
from xds_server.xds.machine.limits import (
    MAX_REJECTED_VERSIONS,
    MAX_RESOURCE_NAMES,
    MAX_RESPONSE_BYTES,
    MAX_SUBSCRIPTION_BYTES,
    MAX_TYPES,
    RESPONSE_HEADROOM,
    FieldLimits,
    FieldTooLarge,
    ProtocolError,
    ResourceLimitExceeded,
    StreamLimits,
)
from xds_server.xds.machine.sotw import SotwStream
from xds_server.xds.machine.state import WILDCARD, Rejections, TypeState

__all__ = [
    "MAX_REJECTED_VERSIONS", "MAX_RESOURCE_NAMES", "MAX_RESPONSE_BYTES",
    "MAX_SUBSCRIPTION_BYTES", "MAX_TYPES", "RESPONSE_HEADROOM", "WILDCARD", "Ack",
    "DeltaStream", "Event", "FieldLimits", "FieldTooLarge", "Nack", "ProtocolError", "Rejections",
    "ResourceLimitExceeded", "Response", "SotwStream", "StaleNonce", "StreamLimits",
    "Subscription", "TypeState", "Withheld", "part_version",
]
