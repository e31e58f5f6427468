"""Envoy (and, for the trimtab policies, `trimtab serve`) in front of the fleet for one policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from trimtab_dev.bench import envoy_configs, reference
from trimtab_dev.bench.fleet import Fleet
from trimtab_dev.bench.processes import (
    READY_TIMEOUT_S,
    STOP_TIMEOUT_S,
    BenchError,
    ChildProcess,
    cli_command,
    http_json,
    port_open,
    signals_deferred,
    wait_until,
)
from trimtab_dev.envoy_process import EnvoyProcess, free_port


# ---- Envoy (+ trimtab) for one policy -----------------------------------------------------
class PolicyStack:
    """Envoy in front of the fleet for one policy; for ``trimtab`` and ``reference`` also
    ``trimtab serve`` (``reference``: ``weights.policy: reference`` every
    :data:`reference.INTERVAL_S`, least_request, one pool, whatever the other arguments
    say)."""

    def __init__(self, policy: str, fleet: Fleet, workdir: Path, *, weights: str = "queueing",
                 interval: float = 2.0, listener_port: int = 0, trimtab_admin_port: int = 0,
                 composite: dict[str, Any] | None = None,
                 long_context: envoy_configs.LongContext | str | None = None,
                 lb_policy: str = "least_request", queueing: dict[str, Any] | None = None,
                 active_request_bias: float | None = None,
                 ttft_slo_s: float | None = None, tenant_header: str | None = None
                 ) -> None:
        if policy not in envoy_configs.POLICIES:
            raise ValueError(f"unknown policy {policy!r}")
        if policy == envoy_configs.REFERENCE:
            weights, interval, composite = reference.WEIGHTS, reference.INTERVAL_S, None
            long_context, lb_policy, queueing = None, reference.LB_POLICY, None
            active_request_bias = None
        self.lb_policy, self.queueing = lb_policy, dict(queueing or {})
        self.active_request_bias = active_request_bias
        self.policy, self.fleet, self.workdir = policy, fleet, workdir
        self.weights, self.interval, self.composite = weights, interval, dict(composite or {})
        self.long_context = long_context
        # the workload's SLO becomes trimtab's (admission); the reference has none
        self.ttft_slo_s = ttft_slo_s if policy == "trimtab" else None
        self.tenant_header = tenant_header
        self.listener_port = listener_port or free_port()
        self.envoy_admin_port = free_port()
        self.trimtab_admin_port = trimtab_admin_port or free_port()
        self.envoy = EnvoyProcess(log_level="warning")
        self.trimtab: ChildProcess | None = None

    @property
    def listener_url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_admin_port}"

    @property
    def trimtab_admin_url(self) -> str | None:
        return f"http://127.0.0.1:{self.trimtab_admin_port}" if self.trimtab else None

    @property
    def via_trimtab(self) -> bool:
        return self.policy in envoy_configs.XDS_POLICIES

    def bootstrap(self, xds_port: int = 0) -> dict[str, Any]:
        if self.via_trimtab:
            return envoy_configs.dynamic_bootstrap(xds_port=xds_port,
                                                   admin_port=self.envoy_admin_port)
        return envoy_configs.static_bootstrap(self.policy, self.fleet.addresses,
                                              listener_port=self.listener_port,
                                              admin_port=self.envoy_admin_port)

    def start(self) -> None:
        """Start and wait until Envoy routes to every host of the fleet."""
        xds_port = self._start_trimtab() if self.via_trimtab else 0
        bootstrap = self.bootstrap(xds_port)
        (self.workdir / f"envoy-{self.policy}.yaml").write_text(yaml.safe_dump(bootstrap))
        self.envoy.start(bootstrap, self.workdir / f"envoy-{self.policy}.log")
        self.envoy.wait_ready(READY_TIMEOUT_S)
        count = len(self.fleet.servers)
        wait_until(lambda: len(self.envoy.host_weights(envoy_configs.CLUSTER)) == count,
                   READY_TIMEOUT_S, f"Envoy to show {count} hosts", self._alive)
        wait_until(lambda: port_open(self.listener_port), READY_TIMEOUT_S,
                   f"Envoy's listener :{self.listener_port}", self._alive)

    def _start_trimtab(self) -> int:
        xds_port = free_port()
        config = envoy_configs.trimtab_config(
            model=self.fleet.model, addresses=self.fleet.addresses, xds_port=xds_port,
            admin_port=self.trimtab_admin_port, listener_port=self.listener_port,
            weights=self.weights, interval=self.interval, composite=self.composite,
            long_context=self.long_context, lb_policy=self.lb_policy, queueing=self.queueing,
            active_request_bias=self.active_request_bias, ttft_slo_s=self.ttft_slo_s,
            tenant_header=self.tenant_header)
        name = "trimtab" if self.policy == "trimtab" else f"trimtab-{self.policy}"
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.trimtab = ChildProcess("trimtab serve", cli_command(
            "--log-level", "warning", "serve", "--config", str(path)),
            self.workdir / f"{name}.log")
        self.trimtab.start()
        wait_until(lambda: http_json(f"{self.trimtab_admin_url}/readyz", 0.5) is not None,
                   READY_TIMEOUT_S, "trimtab /readyz", self.trimtab.check_alive)
        return xds_port

    def _alive(self) -> None:
        if not self.envoy.running():
            raise BenchError(f"Envoy exited; log tail:\n{self.envoy.log_tail()}")
        if self.trimtab is not None:
            self.trimtab.check_alive()

    def close(self) -> None:
        with signals_deferred():
            try:
                self.envoy.stop(STOP_TIMEOUT_S)
            finally:
                if self.trimtab is not None:
                    self.trimtab.stop()
