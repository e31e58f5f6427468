"""The bounds on what a KEDA client sends (docs/security.md, "Intent classifier and KEDA
scaler"), checked before anything else reads a request. Over a bound the call fails with
INVALID_ARGUMENT naming the field and the limit; an error quotes at most `SHOWN_CHARS` of a
peer's string, escaped.
"""

from __future__ import annotations

from xds_server.keda import externalscaler_pb2 as pb2

MAX_MESSAGE_BYTES = 1024 * 1024  # one gRPC message (the bounds below fit in it)
MAX_NAME_CHARS = 253             # a ScaledObject's name and namespace (Kubernetes' own limit)
MAX_METADATA_ENTRIES = 64        # scalerMetadata: the trigger's metadata keys
MAX_METADATA_KEY_CHARS = 253
MAX_METADATA_VALUE_CHARS = 16 * 1024  # room for a PEM certificate in a trigger's metadata
MAX_POOL_CHARS = 253             # scalerMetadata.pool
MAX_METRIC_NAME_CHARS = 512      # GetMetricsRequest.metricName
SHOWN_CHARS = 64


def shown(value: str) -> str:
    """`value` for an error message: repr-escaped, at most `SHOWN_CHARS` of it."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} chars)"


def _too_long(field: str, value: str, limit: int) -> str | None:
    if len(value) <= limit:
        return None
    return f"{field}: {len(value)} chars, over the limit of {limit}"


def ref_problem(ref: pb2.ScaledObjectRef) -> str | None:
    """What in `ref` exceeds a bound, in words naming the field and the limit; else None."""
    problem = (_too_long("scaledObjectRef.name", ref.name, MAX_NAME_CHARS)
               or _too_long("scaledObjectRef.namespace", ref.namespace, MAX_NAME_CHARS))
    if problem is not None:
        return problem
    metadata = ref.scalerMetadata
    if len(metadata) > MAX_METADATA_ENTRIES:
        return (f"scalerMetadata: {len(metadata)} entries, over the limit of "
                f"{MAX_METADATA_ENTRIES}")
    for key, value in metadata.items():
        problem = (_too_long("scalerMetadata key", key, MAX_METADATA_KEY_CHARS)
                   or _too_long(f"scalerMetadata[{shown(key)}]", value,
                                MAX_METADATA_VALUE_CHARS))
        if problem is not None:
            return problem
    return None
