"""Stream observers: everything that watches xDS streams without pumping them.

The servicer (`xds.server`) pumps requests into each stream's sans-IO machine and its
responses out to gRPC, and tells the observers what happened (`base.StreamObserver`): a stream
opened or closed, requested a type, the machine's events (ACK, NACK, stale nonce,
subscription), a response sent (bytes, time), a push withheld, a protocol error. `metrics`
keeps the stream and push metrics, `push_log` the push log lines, `stream_log` the NACK,
withheld and protocol-error lines, `convergence` the telemetry-to-ACK delay; `xds.nacks.NackLog`
(the admin API's NACK log) and `xds.heap.HeapTrimmer` are observers too. `base.Observers` calls
them in turn and keeps a failing one from breaking the stream: it is logged and counted.
"""
