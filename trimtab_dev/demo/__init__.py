"""Demos. ``simulated`` is `make demo`: the simulated heterogeneous fleet behind a real Envoy
and trimtab, compared with unweighted least_request (its live table in ``live``). ``local``
is the small demo: three fake GPU backends (``fake_gpu``) on the documented ports of
examples/local-fake-gpus.yaml (examples/local.yaml's) and envoy-bootstrap.yaml (``layout``)."""
