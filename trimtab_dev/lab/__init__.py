"""The policy lab: the simulated fleet, Envoy's host picking and a weight controller in one
process, in virtual time, for screening weight methods over many seeds in minutes.

It is a development aid, not a benchmark: Envoy's balancers are emulated
(:mod:`.envoy_lb`), so every figure that a claim rests on comes from ``trimtab bench``
through a real Envoy. What the lab shares with the bench is everything else: the engine
(:mod:`trimtab_dev.sim.engine`), the workload schedules, the metrics pages the simulator
serves, trimtab's parser and its weighing path (:func:`xds_server.control.weights.cluster_weights`).

    python -m trimtab_dev.lab --fleet examples/fleet-hetero.yaml \\
        --workload examples/workload-mixed.yaml --seeds 1,2,3 \\
        --policies least_request,reference,trimtab --duration 60
"""
