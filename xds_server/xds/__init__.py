"""The xDS protocol: snapshots, the cache, the sans-IO stream, encoding, the gRPC pump."""
