"""The one definition of an endpoint's health as the weight policies decide it.

``HEALTHY``: usable telemetry, weighed normally. ``DEGRADED``: overloaded (e.g. KV cache past
``kv_degraded``), weight 1 at once, sent to Envoy as EDS DEGRADED. ``STALE``: no recent
telemetry (weight held, then 1). ``INVALID``: telemetry present but unusable. ``WARMING``: new
endpoint ramping up. ``STANDBY``: the queueing split gives it no share at this load (EDS
priority 1: no new requests while priority 0 is available, failover when it is not). A
``StrEnum``, so documents and logs show the plain name.
"""

from __future__ import annotations

from enum import StrEnum


class Health(StrEnum):
    HEALTHY = "HEALTHY"
    DEGRADED = "DEGRADED"
    STALE = "STALE"
    INVALID = "INVALID"
    WARMING = "WARMING"
    STANDBY = "STANDBY"


# The members by name, typed as the ``str`` that EndpointWeight.health holds.
HEALTHY: str = Health.HEALTHY
DEGRADED: str = Health.DEGRADED
STALE: str = Health.STALE
INVALID: str = Health.INVALID
WARMING: str = Health.WARMING
STANDBY: str = Health.STANDBY
