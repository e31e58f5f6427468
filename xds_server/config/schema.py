"""The config's shape: a frozen, validated `Config` and its top-level sections (pools are
in xds_server/config/pools.py). Reading a file is xds_server/config/load.py; the rules that
span sections (names, fallbacks, node assignments) are xds_server/config/checks.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.addresses import HostPort, is_ip, parse_host_port
from xds_server.config.base import Addressed, Model, SourceName
from xds_server.config.pools import PoolConfig

ANY = "*"  # in nodes.clusters, as a key: every cluster not listed; in a pool list: every pool


class TlsConfig(Model):
    """TLS on the xDS port; with require_client_cert + client_ca_file, mutual TLS."""

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    client_ca_file: str | None = None
    require_client_cert: bool = False
    reload: bool = True  # re-read rotated files at the next handshake (cert-manager, secrets)

    @model_validator(mode="after")
    def _mtls_pair(self) -> TlsConfig:
        if self.require_client_cert != (self.client_ca_file is not None):
            raise ValueError("require_client_cert and client_ca_file go together (mTLS); "
                             "grpcio cannot request an optional client certificate")
        return self


class XdsLimitsConfig(Model):
    requests_per_second: float | None = Field(20.0, gt=0)  # per client IP+identity; null: off
    request_burst: int = Field(100, ge=1)
    max_streams: int | None = Field(None, ge=1)  # server-wide concurrent xDS streams
    max_streams_per_connection: int = Field(16, ge=1)
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=64 * 1024)
    max_connection_age_seconds: float | None = Field(None, gt=0)  # GOAWAY after this (±10 %)
    max_connection_age_grace_seconds: float = Field(30.0, ge=0)  # then the stream is cut
    # Names of one type one stream may subscribe to; above: RESOURCE_EXHAUSTED (the peer's fault).
    max_resource_names: int = Field(16_384, ge=1)
    # The largest response sent (gRPC clients' default receive limit); larger pushes are split.
    max_response_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=64 * 1024 * 1024)


class XdsConfig(Addressed):
    address: str = "127.0.0.1:18000"
    tls: TlsConfig | None = None
    limits: XdsLimitsConfig = XdsLimitsConfig()


class AdminAuthConfig(Model):
    """A bearer token for the admin API, from a file or an environment variable (never
    inline: /v1/config shows the effective config)."""

    token_file: str | None = None
    token_env: str | None = None
    protect_reads: bool = False  # also require it for GETs (/healthz, /readyz stay open)

    @model_validator(mode="after")
    def _one_source(self) -> AdminAuthConfig:
        if self.token_file is not None and self.token_env is not None:
            raise ValueError("give token_file or token_env, not both")
        if self.protect_reads and self.token_file is None and self.token_env is None:
            raise ValueError("protect_reads needs token_file or token_env")
        return self


class AdminConfig(Addressed):
    address: str = "127.0.0.1:19100"
    auth: AdminAuthConfig = AdminAuthConfig()



class LocalRepliesConfig(Model):
    """Envoy's own answers (no healthy host, overflow, timeout) as OpenAI-shaped JSON."""

    retry_after_seconds: int = Field(5, ge=0, le=86_400)  # on 503s; 0: no Retry-After header


class ClassifierRuleConfig(Model):
    """The last user message is in `tier` when it contains one of `keywords` (case-insensitive)
    or matches one of `patterns` (Python regular expressions), and its length in characters
    is in [min_chars, max_chars). No keyword and no pattern: the length alone decides."""

    tier: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    keywords: list[str] = Field(default_factory=list, max_length=1000)
    patterns: list[str] = Field(default_factory=list, max_length=100)
    min_chars: int = Field(0, ge=0)
    max_chars: int | None = Field(None, gt=0)

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        import re

        for pattern in value:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"pattern {pattern!r} is not a regular expression: "
                                 f"{exc}") from None
        return value


class ClassifierConfig(Model):
    """The intent classifier: an Envoy ext_proc service that puts a request in an intent tier,
    run by `trimtab serve` itself (``embedded``) or by `trimtab classify`. Envoy fails open:
    a timeout or an outage routes to the pool's default."""

    embedded: bool = True                          # `trimtab serve` runs it (pools with tiers)
    address: str = "127.0.0.1:18081"               # where the classifier listens (IP:port)
    envoy_address: str | None = None               # where Envoy dials it; default: `address`
    message_timeout_ms: int = Field(50, ge=1, le=10_000)
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=8 * 1024 * 1024)  # larger: default
    max_text_chars: int = Field(16_384, ge=16, le=1_000_000)  # of the last user message
    metrics_address: str | None = None             # Prometheus /metrics of the classifier
    rules: list[ClassifierRuleConfig] = Field(min_length=1)
    # "module:factory": factory(ClassifierConfig) -> an object with classify(text) -> tier | None,
    # asked when no rule matches; loaded in the classifier's process, never in trimtab serve's
    learned: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    learned_tiers: list[str] = Field(default_factory=list, max_length=1000)  # tiers it may answer

    @field_validator("address", "envoy_address", "metrics_address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is not None:
            host = parse_host_port(value).host
            if not is_ip(host):
                raise ValueError(f"expected an IP address (Envoy connects to a socket address), "
                                 f"got {host!r}")
        return value

    @property
    def dial_address(self) -> HostPort:
        """Where Envoy's classifier cluster connects: ``envoy_address``, else ``address``
        with a wildcard host (0.0.0.0, ::) read as this host's loopback."""
        if self.envoy_address is not None:
            return parse_host_port(self.envoy_address)
        where = parse_host_port(self.address)
        loopback = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(where.host, where.host)
        return HostPort(loopback, where.port)


class ListenerConfig(Addressed):
    address: str = "0.0.0.0:10000"
    local_replies: LocalRepliesConfig = LocalRepliesConfig()
    # Modality: look at most this many bytes of a body (from its start) for content parts.
    modality_inspect_bytes: int = Field(1024 * 1024, ge=1024, le=8 * 1024 * 1024)


class PrometheusSourceConfig(Model):
    url: str = "http://127.0.0.1:9090"
    label: str = "instance"                 # the series label that names the endpoint
    queries: dict[str, str] | None = None   # signal -> PromQL; default: vLLM + DCGM queries

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value


class TelemetryConfig(Model):
    interval_seconds: float = Field(2.0, gt=0)
    stale_after_seconds: float = Field(6.0, gt=0)
    timeout_seconds: float | None = Field(None, gt=0)
    max_concurrency: int = Field(64, ge=1)
    source: SourceName = "scrape"           # default for pools; a pool may pick its own
    latency_window_seconds: float = Field(30.0, gt=0)  # decode latency: windowed mean ITL
    max_series_per_page: int = Field(20_000, ge=1)  # a page with more is refused unparsed
    prometheus: PrometheusSourceConfig = PrometheusSourceConfig()
    file: str | None = None                 # source `file`: YAML/JSON {address: {signal: value}}

    @model_validator(mode="after")
    def _timeout_below_interval(self) -> TelemetryConfig:
        if self.timeout_seconds is not None and self.timeout_seconds >= self.interval_seconds:
            raise ValueError(
                f"timeout_seconds ({self.timeout_seconds}) must be below interval_seconds "
                f"({self.interval_seconds})")
        return self

    @property
    def scrape_timeout(self) -> float:
        """The per-scrape timeout: configured, else 80 % of the interval."""
        return self.timeout_seconds if self.timeout_seconds is not None else self.interval_seconds * 0.8


class CompositeConfig(Model):
    """The composite policy's knobs (weight_calculator/composite.py)."""

    memory_mix: float = Field(0.40, ge=0)
    queue_mix: float = Field(0.35, ge=0)
    latency_mix: float = Field(0.25, ge=0)
    queue_cap: float = Field(32.0, gt=0)
    itl_slo_ms: float = Field(50.0, gt=0)
    ewma_alpha: float = Field(0.5, gt=0, le=1)
    deadband: float = Field(3.0, ge=0)
    kv_degraded: float = Field(0.95, gt=0, le=1)
    staleness: Literal["saturated", "hold", "ignore"] = "saturated"

    @model_validator(mode="after")
    def _some_mix(self) -> CompositeConfig:
        if self.memory_mix + self.queue_mix + self.latency_mix <= 0:
            raise ValueError("at least one of memory_mix, queue_mix, latency_mix must be > 0")
        return self


class QueueingConfig(Model):
    """The queueing policy's knobs (weight_calculator/queueing.py); the backlog horizon is
    the telemetry interval."""

    window_seconds: float = Field(20.0, gt=0)     # counter reads used for the rates
    rate_alpha: float = Field(0.5, gt=0, le=1)    # EWMA of the service-rate estimate
    min_utilisation: float = Field(0.05, gt=0, le=1)
    deadband: float = Field(0.10, ge=0, lt=1)     # relative to the previous weight
    rise_alpha: float = Field(0.5, gt=0, le=1)    # rises are smoothed, drops apply at once
    kv_degraded: float = Field(0.95, gt=0, le=1)
    staleness: Literal["saturated", "hold", "ignore"] = "saturated"
    split: Literal["equal_spare", "square_root", "proportional"] = "equal_spare"
    utilisation: Literal["queued", "saturated", "kv"] = "queued"
    work: Literal["tokens", "prompt"] = "tokens"
    in_flight_share: float = Field(0.5, ge=0, le=1)  # a running request's remaining work
    standby: bool = True  # tiers the split leaves out: EDS priority 1 (failover only)
    # least_request divides weights by (active + 1) ** bias: multiply it back in (round 2)
    compensate_active: bool = True
    # one Envoy locality per capacity tier, weighted by the tier's share, equal host weights
    # inside it under least_request (round 3); false: one locality, per-endpoint weights
    capacity_tiers: bool = True


class WeightsConfig(Model):
    # reference: issue 11's baseline controller, for benchmarks (weight_calculator/reference.py)
    policy: Literal["gpu_memory", "composite", "queueing", "reference"] = "queueing"
    max_weight: int = Field(100, ge=1, le=128)
    composite: CompositeConfig = CompositeConfig()
    queueing: QueueingConfig = QueueingConfig()


class KedaConfig(Model):
    """The KEDA external scaler's gRPC address; absent: no scaler is served."""

    address: str | None = None

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value


class RolloutsConfig(Model):
    # Canary state survives restarts here; relative paths are relative to the config file.
    state_file: str = "trimtab-rollouts.json"
    # Deprecated (embedded mode only; ignored with `coordination.kubernetes`, where the Lease
    # holder drives): with N replicas sharing the state file, exactly one drives (advances
    # and writes); the others follow: they re-read the file every tick and route by it.
    drive: bool = True


class KubernetesCoordinationConfig(Model):
    """Leader election with a coordination.k8s.io/v1 Lease, rollout state in a ConfigMap."""

    namespace: str = Field(min_length=1)
    lease_name: str = Field("trimtab-leader", min_length=1)
    lease_seconds: int = Field(15, ge=1)      # the Lease's leaseDurationSeconds
    renew_seconds: float = Field(2.0, gt=0)   # how often the leader renews, candidates retry
    # A leader that has not renewed for this long stops leading; default 2/3 of lease_seconds
    renew_deadline_seconds: float | None = Field(None, gt=0)
    state_configmap: str = Field("trimtab-rollouts", min_length=1)
    identity: str | None = Field(None, min_length=1)  # default: $POD_NAME, else host + random
    api_server: str | None = None             # default: in-cluster service account, else kubeconfig

    @property
    def renew_deadline(self) -> float:
        if self.renew_deadline_seconds is not None:
            return self.renew_deadline_seconds
        return self.lease_seconds * 2 / 3

    @model_validator(mode="after")
    def _timing(self) -> KubernetesCoordinationConfig:
        if not self.renew_seconds < self.renew_deadline < self.lease_seconds:
            raise ValueError(
                f"expected renew_seconds ({self.renew_seconds:g}) < renew deadline "
                f"({self.renew_deadline:g}) < lease_seconds ({self.lease_seconds}): a leader "
                f"must stop leading before another replica may take the Lease")
        return self


class CoordinationConfig(Model):
    """How replicas share the singleton duties (rollouts); absent: embedded mode."""

    kubernetes: KubernetesCoordinationConfig | None = None


class NodesConfig(Model):
    """Node cluster -> pools it may see ("*" key: any other cluster; "*" pool: every pool)."""

    clusters: dict[str, list[str]] = Field(default_factory=lambda: {"*": ["*"]})
    require_san_match: bool = False  # mTLS: a client certificate SAN must name the node
    require_cluster_binding: bool = False  # ... and must name its cluster, not only its id
    trust_domain: str | None = None  # only spiffe://<trust_domain>/... URI SANs count
    dns_suffix: str | None = None  # DNS SANs must end in .<dns_suffix>, removed before parsing

    @model_validator(mode="after")
    def _san_options(self) -> NodesConfig:
        if (self.require_cluster_binding or self.trust_domain) and not self.require_san_match:
            raise ValueError("require_cluster_binding and trust_domain need require_san_match")
        if self.dns_suffix is not None and (not all(self.dns_suffix.strip(".").split("."))
                                            or "*" in self.dns_suffix):
            raise ValueError(f"dns_suffix {self.dns_suffix!r} is not a DNS name")
        return self


class DnsDiscoveryConfig(Model):
    """Endpoints addressed by DNS name: how they are resolved (xds_server/control/discovery/dns.py)."""

    refresh_seconds: float = Field(30.0, ge=1, le=86_400)   # each name re-resolved this often
    retry_seconds: float = Field(5.0, gt=0, le=3600)        # a failed name: min(this, refresh)
    timeout_seconds: float = Field(2.0, gt=0, le=30)        # one lookup, queueing included
    stale_seconds: float = Field(300.0, ge=0, le=86_400)    # last good addresses kept on failure
    max_names: int = Field(256, ge=1, le=10_000)            # distinct names in a config
    max_addresses_per_name: int = Field(64, ge=1, le=1024)  # more: the first N, sorted, kept
    max_concurrent_lookups: int = Field(4, ge=1, le=64)     # resolver threads
    family: Literal["any", "ipv4", "ipv6"] = "any"

    @model_validator(mode="after")
    def _timeout_below_refresh(self) -> DnsDiscoveryConfig:
        if self.timeout_seconds >= self.refresh_seconds:
            raise ValueError(f"timeout_seconds ({self.timeout_seconds}) must be below "
                             f"refresh_seconds ({self.refresh_seconds})")
        return self


class DiscoverySettingsConfig(Model):
    """Discovery settings shared by every pool (a pool's own `discovery` picks its source)."""

    dns: DnsDiscoveryConfig = DnsDiscoveryConfig()


class Config(Model):
    xds: XdsConfig = XdsConfig()
    admin: AdminConfig = AdminConfig()
    listener: ListenerConfig = ListenerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    weights: WeightsConfig = WeightsConfig()
    rollouts: RolloutsConfig = RolloutsConfig()
    coordination: CoordinationConfig = CoordinationConfig()
    keda: KedaConfig = KedaConfig()
    nodes: NodesConfig | None = None  # absent: every node sees every pool
    classifier: ClassifierConfig | None = None  # intent tiers (`trimtab classify`)
    discovery: DiscoverySettingsConfig = DiscoverySettingsConfig()  # endpoints by DNS name
    pools: list[PoolConfig] = Field(min_length=1)

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)
