"""The sans-IO xDS stream machines, one concern per module (the overview is `xds.protocol`,
which re-exports the public names; import them from there).

`limits` (what a stream may ask for and be sent), `bounds` (checking the peer's strings against
them), `events` (what `receive()` and `responses()` return), `state` (per-type state and the
stream's rejections), `base` (what SotW and Delta share: node, nonces, packing, flow control,
the subscription byte budget), `sotw` and `delta`.
"""
