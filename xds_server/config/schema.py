"""The config contract: YAML in, a frozen, validated `Config` out.

Every error names the key path and the reason, e.g.
``pools[1].endpoints[0].address: expected host:port, got 'foo'``.
The CLI turns a `ConfigError` into exit status 2.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

LbPolicy = Literal["round_robin", "least_request", "ring_hash", "maglev", "random"]
LB_POLICIES: tuple[str, ...] = ("round_robin", "least_request", "ring_hash", "maglev", "random")


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds (key path, reason) pairs."""

    def __init__(self, problems: Iterable[tuple[str, str]]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(f"{path}: {reason}" if path else reason
                                   for path, reason in self.problems))


@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(value: str) -> HostPort:
    """Parse ``host:port`` (``[v6]:port`` for IPv6). Raises ValueError with the reason."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"expected host:port, got {value!r}")
    host, _, port_text = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port_text.isdigit():
        raise ValueError(f"expected host:port, got {value!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535, got {port} in {value!r}")
    if any(ch.isspace() for ch in host):
        raise ValueError(f"expected host:port, got {value!r}")
    return HostPort(host, port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Addressed(_Model):
    address: str

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @property
    def host_port(self) -> HostPort:
        return parse_host_port(self.address)


class TlsConfig(_Model):
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


class XdsLimitsConfig(_Model):
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


class XdsConfig(_Addressed):
    address: str = "127.0.0.1:18000"
    tls: TlsConfig | None = None
    limits: XdsLimitsConfig = XdsLimitsConfig()


class AdminAuthConfig(_Model):
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


class AdminConfig(_Addressed):
    address: str = "127.0.0.1:19100"
    auth: AdminAuthConfig = AdminAuthConfig()


class NumberRangeConfig(_Model):
    """A range of a JSON number in the request body: ``min`` inclusive, ``max`` exclusive."""

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _bounded(self) -> NumberRangeConfig:
        values = [v for v in (self.min, self.max) if v is not None]
        if not values:
            raise ValueError("give min, max or both")
        if any(v != v or abs(v) > 1e15 for v in values):
            raise ValueError("min and max must be finite numbers within +-1e15")
        if self.min is not None and self.max is not None and self.max <= self.min:
            raise ValueError(f"max ({self.max}) must be above min ({self.min})")
        return self


class RequestClassConfig(_Model):
    """Requests for this pool's model that match every condition given go to `pool` instead
    (xds_server/envoy/request_features.py). Checked in order, before the prompt-size classes."""

    pool: str = Field(min_length=1)
    modality: Literal["image", "audio"] | None = None  # a message content part of that kind
    max_tokens: NumberRangeConfig | None = None   # max_completion_tokens, else max_tokens
    stream: bool | None = None                    # the body's "stream" (must be present)
    n: NumberRangeConfig | None = None
    temperature: NumberRangeConfig | None = None

    @model_validator(mode="after")
    def _some_condition(self) -> RequestClassConfig:
        if all(getattr(self, key) is None for key in REQUEST_FEATURES):
            raise ValueError(f"needs at least one of {', '.join(REQUEST_FEATURES)}")
        return self


REQUEST_FEATURES: tuple[str, ...] = ("modality", "max_tokens", "stream", "n", "temperature")


class StaticResponseConfig(_Model):
    """What a client gets instead of a 503 when this pool (and its fallback) has no healthy
    host: the seed's StaticResponse fallback."""

    status: int = Field(200, ge=200, le=599)
    body: str = Field(min_length=1, max_length=64 * 1024)
    content_type: str = Field("application/json", min_length=1, max_length=256)


class ModelVersionsConfig(_Model):
    """A request asking for a model version (header, or a body field) goes to the pool serving
    it while that pool has healthy hosts, else to this pool (an aggregate cluster)."""

    header: str = Field("x-model-version", min_length=1, max_length=128)
    body_field: str | None = Field("model_version", min_length=1, max_length=128)  # None: off
    pools: dict[str, str] = Field(min_length=1)  # version label -> the pool serving it

    @field_validator("pools")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for label in value:
            if not label or len(label) > 128 or any(ch.isspace() for ch in label):
                raise ValueError(f"expected version labels of 1..128 characters without "
                                 f"spaces, got {label!r}")
        return value


class LocalRepliesConfig(_Model):
    """Envoy's own answers (no healthy host, overflow, timeout) as OpenAI-shaped JSON."""

    retry_after_seconds: int = Field(5, ge=0, le=86_400)  # on 503s; 0: no Retry-After header


class ClassifierRuleConfig(_Model):
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


class ClassifierConfig(_Model):
    """`trimtab classify`: an Envoy ext_proc service that puts a request in an intent tier.
    Envoy fails open: a timeout or an outage routes to the pool's default."""

    address: str = "127.0.0.1:18081"               # where `trimtab classify` listens (IP:port)
    message_timeout_ms: int = Field(50, ge=1, le=10_000)
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=8 * 1024 * 1024)  # larger: default
    max_text_chars: int = Field(16_384, ge=16, le=1_000_000)  # of the last user message
    metrics_address: str | None = None             # Prometheus /metrics of the classifier
    rules: list[ClassifierRuleConfig] = Field(min_length=1)

    @field_validator("address", "metrics_address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is not None:
            host = parse_host_port(value).host
            if not is_ip(host):
                raise ValueError(f"expected an IP address (Envoy connects to a socket address), "
                                 f"got {host!r}")
        return value


class ListenerConfig(_Addressed):
    address: str = "0.0.0.0:10000"
    local_replies: LocalRepliesConfig = LocalRepliesConfig()
    # Modality: look at most this many bytes of a body (from its start) for content parts.
    modality_inspect_bytes: int = Field(1024 * 1024, ge=1024, le=8 * 1024 * 1024)


SourceName = Literal["scrape", "prometheus", "static", "file"]


class PrometheusSourceConfig(_Model):
    url: str = "http://127.0.0.1:9090"
    label: str = "instance"                 # the series label that names the endpoint
    queries: dict[str, str] | None = None   # signal -> PromQL; default: vLLM + DCGM queries

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value


class TelemetryConfig(_Model):
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


class CompositeConfig(_Model):
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


class QueueingConfig(_Model):
    """The queueing policy's knobs (weight_calculator/queueing.py); the backlog horizon is
    the telemetry interval."""

    window_seconds: float = Field(20.0, gt=0)     # counter reads used for the rates
    rate_alpha: float = Field(0.5, gt=0, le=1)    # EWMA of the service-rate estimate
    min_utilisation: float = Field(0.05, gt=0, le=1)
    deadband: float = Field(0.10, ge=0, lt=1)     # relative to the previous weight
    rise_alpha: float = Field(0.5, gt=0, le=1)    # rises are smoothed, drops apply at once
    kv_degraded: float = Field(0.95, gt=0, le=1)
    staleness: Literal["saturated", "hold", "ignore"] = "saturated"
    split: Literal["square_root", "proportional"] = "square_root"
    utilisation: Literal["saturated", "kv"] = "saturated"
    work: Literal["tokens", "prompt"] = "tokens"
    in_flight_share: float = Field(0.5, ge=0, le=1)  # a running request's remaining work
    standby: bool = True  # endpoints the split leaves out: EDS DRAINING (no new requests)


class WeightsConfig(_Model):
    # reference: issue 11's baseline controller, for benchmarks (weight_calculator/reference.py)
    policy: Literal["gpu_memory", "composite", "queueing", "reference"] = "queueing"
    max_weight: int = Field(100, ge=1, le=128)
    composite: CompositeConfig = CompositeConfig()
    queueing: QueueingConfig = QueueingConfig()


class EndpointConfig(_Addressed):
    metrics_url: str | None = None
    dcgm_url: str | None = None     # the node's DCGM exporter, merged with the model server's page
    gpu: str | None = None          # pick this GPU (DCGM label `gpu`) on a multi-GPU page
    uuid: str | None = None         # ... or this one (DCGM label `UUID`)
    capacity: float | None = Field(None, gt=0)   # KV-cache tokens, if the server doesn't say
    instance: str | None = None     # source prometheus: the label value naming this endpoint
    signals: dict[str, float] | None = None      # source static: fixed telemetry
    drain: bool = False

    @field_validator("metrics_url", "dcgm_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or f"http://{self.address}/metrics"


class PromptClassConfig(_Model):
    """Requests whose content-length is in [min_prompt_bytes, max_prompt_bytes) go to `pool`.
    About 4 bytes of JSON per prompt token; see docs/configuration.md for the approximation's limits."""

    pool: str = Field(min_length=1)
    min_prompt_bytes: int = Field(ge=0)
    max_prompt_bytes: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> PromptClassConfig:
        if self.max_prompt_bytes is not None and self.max_prompt_bytes <= self.min_prompt_bytes:
            raise ValueError(f"max_prompt_bytes ({self.max_prompt_bytes}) must be above "
                             f"min_prompt_bytes ({self.min_prompt_bytes})")
        return self

    @property
    def upper(self) -> int:
        return self.max_prompt_bytes if self.max_prompt_bytes is not None else 2**63 - 1


class VersionConfig(_Model):
    endpoints: list[EndpointConfig] = Field(min_length=1)


class GateConfig(_Model):
    """SLO gates: the canary may be at most this much worse than stable."""

    ttft_p95_tolerance: float = Field(0.20, ge=0)   # relative: 0.2 = 20 % slower allowed
    itl_p95_tolerance: float = Field(0.20, ge=0)
    error_rate_tolerance: float = Field(0.01, ge=0)  # absolute: 0.01 = one point more errors
    min_requests: int = Field(20, ge=1)             # per version per step before judging


class RolloutConfig(_Model):
    start_percent: float = Field(10.0, gt=0, le=100)
    step_percent: float = Field(5.0, gt=0, le=100)
    step_interval_seconds: float = Field(300.0, gt=0)
    max_percent: float = Field(100.0, gt=0, le=100)
    gates: GateConfig = GateConfig()

    @model_validator(mode="after")
    def _ordered(self) -> RolloutConfig:
        if self.max_percent < self.start_percent:
            raise ValueError(f"max_percent ({self.max_percent}) is below start_percent "
                             f"({self.start_percent})")
        return self


class RetryConfig(_Model):
    retry_on: list[str] = ["connect-failure", "reset", "retriable-status-codes"]
    retriable_status_codes: list[int] = [503]
    num_retries: int = Field(2, ge=0, le=10)
    per_try_timeout_seconds: float = Field(0.0, ge=0)  # 0: none (streams are long)
    budget_percent: float = Field(20.0, gt=0, le=100)  # Envoy retry budget
    min_retry_concurrency: int = Field(3, ge=0)


class CircuitBreakerConfig(_Model):
    max_connections: int = Field(100_000, ge=1)
    max_pending_requests: int = Field(100_000, ge=1)
    max_requests: int = Field(100_000, ge=1)


class OutlierDetectionConfig(_Model):
    enabled: bool = True
    consecutive_5xx: int = Field(5, ge=1)
    interval_seconds: float = Field(5.0, gt=0)
    base_ejection_seconds: float = Field(30.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)


class TimeoutConfig(_Model):
    connect_seconds: float = Field(2.0, gt=0)
    request_seconds: float = Field(0.0, ge=0)  # 0: no overall limit: LLM streams run for minutes
    idle_seconds: float = Field(300.0, gt=0)   # a stream silent this long is closed


class SlowStartConfig(_Model):
    window_seconds: float = Field(30.0, gt=0)
    aggression: float = Field(1.0, gt=0)
    min_weight_percent: float = Field(10.0, ge=0, le=100)


class AffinityConfig(_Model):
    header: str = Field(min_length=1)
    hash: Literal["ring_hash", "maglev"] = "ring_hash"


class HealthCheckConfig(_Model):
    path: str = "/health"
    interval_seconds: float = Field(1.0, gt=0)
    timeout_seconds: float = Field(1.0, gt=0)
    unhealthy_threshold: int = Field(2, ge=1)
    healthy_threshold: int = Field(1, ge=1)


class ScalingConfig(_Model):
    """The seed's dual-metric autoscaler (served to KEDA); see weight_calculator/scaling.py."""

    latency_slo_seconds: float = Field(1.0, gt=0)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(10, ge=1)
    scale_up_threshold: float = Field(0.8, gt=0)
    scale_down_threshold: float = Field(0.3, ge=0)
    scale_up_cooldown_seconds: float = Field(60.0, ge=0)
    scale_down_cooldown_seconds: float = Field(120.0, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> ScalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas "
                             f"({self.min_replicas})")
        if self.scale_down_threshold >= self.scale_up_threshold:
            raise ValueError("scale_down_threshold must be below scale_up_threshold")
        return self


class KubernetesDiscoveryConfig(_Model):
    namespace: str = Field(min_length=1)
    service: str = Field(min_length=1)
    port_name: str | None = None        # the EndpointSlice port; default: the only port
    api_server: str | None = None       # default: in-cluster service account, else kubeconfig


class DiscoveryConfig(_Model):
    kubernetes: KubernetesDiscoveryConfig


class PoolConfig(_Model):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    # least_request on the queueing weights measured best (docs/results/weights.md)
    lb_policy: LbPolicy = "least_request"
    # least_request only: Envoy divides each weight by (active + 1) ** bias (default 1.0)
    active_request_bias: float | None = Field(None, ge=0, le=100)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    versions: dict[Literal["stable", "canary"], VersionConfig] | None = None
    rollout: RolloutConfig | None = None
    # "auto": classes derived from the endpoints' KV capacities (xds_server/envoy/prompt_classes.py)
    long_context: PromptClassConfig | Literal["auto"] | None = None
    prompt_classes: list[PromptClassConfig] = Field(default_factory=list)
    fallback: str | None = None
    retry_policy: RetryConfig = RetryConfig()
    circuit_breakers: CircuitBreakerConfig = CircuitBreakerConfig()
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    slow_start: SlowStartConfig | None = None
    warmup_weight: int = Field(10, ge=1)
    affinity: AffinityConfig | None = None
    health_check: HealthCheckConfig | None = None
    scaling: ScalingConfig | None = None
    discovery: DiscoveryConfig | None = None    # endpoints from Kubernetes EndpointSlices
    telemetry_source: SourceName | None = None  # default: telemetry.source
    itl_slo_ms: float | None = Field(None, gt=0)  # default: weights.composite.itl_slo_ms
    request_classes: list[RequestClassConfig] = Field(default_factory=list)
    static_response: StaticResponseConfig | None = None
    model_versions: ModelVersionsConfig | None = None
    intent_tiers: dict[str, str] | None = None  # classifier tier -> pool

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if any(ch.isspace() for ch in value) or value.startswith("trimtab-"):
            raise ValueError(f"expected a cluster name without spaces or the reserved "
                             f"'trimtab-' prefix, got {value!r}")
        return value

    @model_validator(mode="after")
    def _endpoints_or_versions(self) -> PoolConfig:
        if self.discovery is not None and self.versions is not None:
            raise ValueError("`discovery` and `versions` cannot be combined yet")
        if self.versions is None:
            if not self.endpoints and self.discovery is None:
                raise ValueError("needs `endpoints` (or `versions: {stable, canary}`, or "
                                 "`discovery`)")
            if self.rollout is not None:
                raise ValueError("`rollout` needs `versions: {stable, canary}`")
        elif self.endpoints:
            raise ValueError("give either `endpoints` or `versions`, not both")
        elif set(self.versions) != {"stable", "canary"}:
            raise ValueError("`versions` needs both `stable` and `canary`")
        if self.active_request_bias is not None and self.effective_lb_policy != "least_request":
            raise ValueError("`active_request_bias` works only with least_request")
        if self.slow_start is not None and self.effective_lb_policy not in ("round_robin",
                                                                            "least_request"):
            raise ValueError("`slow_start` works only with round_robin or least_request "
                             "(and not with affinity)")
        return self

    @property
    def effective_lb_policy(self) -> str:
        return self.affinity.hash if self.affinity is not None else self.lb_policy

    @property
    def canary_cluster(self) -> str:
        return f"{self.name}-canary"

    @property
    def fallback_cluster(self) -> str:
        return f"{self.name}-with-fallback"

    def clusters(self) -> list[tuple[str, str, list[EndpointConfig]]]:
        """(EDS cluster name, version, endpoints): the stable cluster keeps the pool's name."""
        if self.versions is None:
            return [(self.name, "stable", self.endpoints)]
        return [(self.name, "stable", self.versions["stable"].endpoints),
                (self.canary_cluster, "canary", self.versions["canary"].endpoints)]

    def all_endpoints(self) -> list[EndpointConfig]:
        return [ep for _, _, endpoints in self.clusters() for ep in endpoints]

    def source(self, config: Config) -> str:
        return self.telemetry_source or config.telemetry.source

    def size_classes(self) -> list[PromptClassConfig]:
        extra = [self.long_context] if isinstance(self.long_context, PromptClassConfig) else []
        return [*self.prompt_classes, *extra]

    @property
    def auto_classes(self) -> bool:
        """``long_context: auto``: prompt-size classes derived from KV capacities."""
        return self.long_context == "auto"


class KedaConfig(_Model):
    """The KEDA external scaler's gRPC address; absent: no scaler is served."""

    address: str | None = None

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_port(value)
        return value


class RolloutsConfig(_Model):
    # Canary state survives restarts here; relative paths are relative to the config file.
    state_file: str = "trimtab-rollouts.json"
    # Deprecated (embedded mode only; ignored with `coordination.kubernetes`, where the Lease
    # holder drives): with N replicas sharing the state file, exactly one drives (advances
    # and writes); the others follow: they re-read the file every tick and route by it.
    drive: bool = True


class KubernetesCoordinationConfig(_Model):
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


class CoordinationConfig(_Model):
    """How replicas share the singleton duties (rollouts); absent: embedded mode."""

    kubernetes: KubernetesCoordinationConfig | None = None


class NodesConfig(_Model):
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


class Config(_Model):
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
    pools: list[PoolConfig] = Field(min_length=1)

    def pool(self, name: str) -> PoolConfig:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _reason(error: Any) -> str:
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
    if error["type"] == "literal_error":
        message = f"{message}, got {error['input']!r}"
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return message


def _pydantic_problems(exc: ValidationError) -> list[tuple[str, str]]:
    return [(_format_loc(tuple(err["loc"])), _reason(err)) for err in exc.errors()]


def _duplicates(values: list[str]) -> list[tuple[int, int]]:
    """(index, first index) pairs for every repeated value."""
    seen: dict[str, int] = {}
    found = []
    for index, value in enumerate(values):
        if value in seen:
            found.append((index, seen[value]))
        else:
            seen[value] = index
    return found


def _endpoint_paths(p_index: int, pool: PoolConfig) -> list[tuple[str, EndpointConfig]]:
    if pool.versions is None:
        return [(f"pools[{p_index}].endpoints[{i}]", ep) for i, ep in enumerate(pool.endpoints)]
    return [(f"pools[{p_index}].versions.{version}.endpoints[{i}]", ep)
            for version in ("stable", "canary")
            for i, ep in enumerate(pool.versions[version].endpoints)]  # type: ignore[index]


def _endpoint_checks(p_index: int, pool: PoolConfig) -> list[tuple[str, str]]:
    problems = []
    seen: dict[str, str] = {}
    for path, endpoint in _endpoint_paths(p_index, pool):
        address = str(endpoint.host_port)
        if address in seen:
            problems.append((f"{path}.address",
                             f"duplicate endpoint address {address!r} (also {seen[address]})"))
        seen.setdefault(address, path)
        if not is_ip(endpoint.host_port.host):
            problems.append((f"{path}.address", f"expected an IP address (EDS endpoints are "
                                                f"IPs), got {endpoint.host_port.host!r}"))
    return problems


def _class_checks(p_index: int, pool: PoolConfig, names: set[str]) -> list[tuple[str, str]]:
    problems = []
    classes = [(f"pools[{p_index}].prompt_classes[{i}]", c) for i, c in enumerate(pool.prompt_classes)]
    if isinstance(pool.long_context, PromptClassConfig):
        classes.append((f"pools[{p_index}].long_context", pool.long_context))
    elif pool.auto_classes and (pool.versions is not None or pool.prompt_classes):
        problems.append((f"pools[{p_index}].long_context", "`auto` cannot be combined with "
                         "`versions` or `prompt_classes` (yet)"))
    for index, (path, cls) in enumerate(classes):
        if cls.pool not in names or cls.pool == pool.name:
            problems.append((f"{path}.pool", f"expected another pool's name, got {cls.pool!r}"))
        for other_path, other in classes[:index]:
            if cls.min_prompt_bytes < other.upper and other.min_prompt_bytes < cls.upper:
                problems.append((path, f"size range overlaps {other_path}"))
    return problems


def _fallback_checks(config: Config) -> list[tuple[str, str]]:
    problems = []
    by_name = {pool.name: pool for pool in config.pools}
    for index, pool in enumerate(config.pools):
        if pool.fallback is None:
            continue
        if pool.fallback not in by_name or pool.fallback == pool.name:
            problems.append((f"pools[{index}].fallback",
                             f"expected another pool's name, got {pool.fallback!r}"))
            continue
        chain, current = [pool.name], by_name[pool.fallback]
        while current.fallback is not None and current.fallback in by_name:
            chain.append(current.name)
            if current.fallback in chain:
                problems.append((f"pools[{index}].fallback", "fallback cycle: "
                                 + " -> ".join([*chain, current.fallback])))
                break
            current = by_name[current.fallback]
    return problems


def _name_checks(config: Config) -> list[tuple[str, str]]:
    problems = []
    for index, first in _duplicates([p.name for p in config.pools]):
        problems.append((f"pools[{index}].name",
                         f"duplicate pool name {config.pools[index].name!r} (also pools[{first}])"))
    class_targets = {c.pool for p in config.pools for c in p.size_classes()}
    class_targets |= {c.pool for p in config.pools for c in p.request_classes}
    class_targets |= {t for p in config.pools if p.intent_tiers for t in p.intent_tiers.values()}
    class_targets |= {t for p in config.pools if p.model_versions
                      for t in p.model_versions.pools.values()}
    models = [p.model if p.name not in class_targets else f"\0{p.name}" for p in config.pools]
    for index, first in _duplicates(models):
        problems.append((f"pools[{index}].model",
                         f"model {config.pools[index].model!r} is already served by pools[{first}]"))
    derived = {n: p.name for p in config.pools for n in (p.canary_cluster, p.fallback_cluster)}
    for index, pool in enumerate(config.pools):
        if pool.name in derived:
            problems.append((f"pools[{index}].name", f"{pool.name!r} clashes with a cluster "
                             f"trimtab derives for pool {derived[pool.name]!r}"))
    return problems


def _source_checks(config: Config) -> list[tuple[str, str]]:
    problems = []
    for p_index, pool in enumerate(config.pools):
        source = pool.source(config)
        if source == "file" and config.telemetry.file is None:
            problems.append((f"pools[{p_index}]", "telemetry source `file` needs telemetry.file"))
        if source != "static":
            continue
        for path, endpoint in _endpoint_paths(p_index, pool):
            if endpoint.signals is None:
                problems.append((f"{path}.signals", "telemetry source `static` needs signals"))
    return problems


def _rollout_source_checks(config: Config) -> list[tuple[str, str]]:
    """A canary's SLO gates read `slo:*` signals (latency histograms, request and error
    counters), and only the scrape source parses them from the metrics pages: with any other
    source a rollout would never see a request and so never step."""
    problems = []
    for p_index, pool in enumerate(config.pools):
        source = pool.source(config)
        if pool.versions is None or source == "scrape":
            continue
        origin = "" if pool.telemetry_source is not None else " (from telemetry.source)"
        problems.append((f"pools[{p_index}].telemetry_source",
                         f"a canary rollout (`versions`) needs telemetry source `scrape`: its "
                         f"SLO gates read latency histograms and request counters from the "
                         f"endpoints' metrics pages; this pool reads {source!r}{origin}"))
    return problems


def _listener_checks(config: Config) -> list[tuple[str, str]]:
    host = config.listener.host_port.host
    if is_ip(host):
        return []
    return [("listener.address", f"expected an IP address (Envoy binds a listener to a socket "
                                 f"address, not a hostname), got {host!r}")]


def _cross_checks(config: Config) -> list[tuple[str, str]]:
    problems = _name_checks(config) + _fallback_checks(config) + _source_checks(config)
    problems += _rollout_source_checks(config) + _listener_checks(config)
    names = {pool.name for pool in config.pools}
    for p_index, pool in enumerate(config.pools):
        problems += _endpoint_checks(p_index, pool) + _class_checks(p_index, pool, names)
    problems += _request_class_checks(config)
    return problems + _security_checks(config)


def _request_class_checks(config: Config) -> list[tuple[str, str]]:
    names = {pool.name for pool in config.pools}
    return [(f"pools[{p}].request_classes[{i}].pool", f"expected another pool's name, got "
             f"{cls.pool!r}")
            for p, pool in enumerate(config.pools) for i, cls in enumerate(pool.request_classes)
            if cls.pool not in names or cls.pool == pool.name] + _version_checks(config, names)


def _version_checks(config: Config, names: set[str]) -> list[tuple[str, str]]:
    return [(f"pools[{p}].model_versions.pools.{label}", f"expected another pool's name, "
             f"got {target!r}")
            for p, pool in enumerate(config.pools) if pool.model_versions is not None
            for label, target in pool.model_versions.pools.items()
            if target not in names or target == pool.name] + _tier_checks(config, names)


def _tier_checks(config: Config, names: set[str]) -> list[tuple[str, str]]:
    problems = []
    tiers = {rule.tier for rule in config.classifier.rules} if config.classifier else set()
    for p, pool in enumerate(config.pools):
        for tier, target in (pool.intent_tiers or {}).items():
            path = f"pools[{p}].intent_tiers.{tier}"
            if config.classifier is None:
                problems.append((path, "intent tiers need a top-level `classifier`"))
            elif tier not in tiers:
                problems.append((path, f"no classifier rule puts requests in tier {tier!r}"))
            if target not in names or target == pool.name:
                problems.append((path, f"expected another pool's name, got {target!r}"))
    return problems


def _security_checks(config: Config) -> list[tuple[str, str]]:
    from xds_server.security.guard import node_pool_problems  # security imports this module

    if config.nodes is None:
        return []
    problems = node_pool_problems(config.nodes.clusters, config)
    tls = config.xds.tls
    if config.nodes.require_san_match and (tls is None or not tls.require_client_cert):
        problems.append(("nodes.require_san_match",
                         "needs mTLS: xds.tls with client_ca_file and require_client_cert: true"))
    return problems


def parse_config(data: Any) -> Config:
    """Validate an already-parsed YAML document. Raises ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([("", f"expected a mapping at the top level, got {type(data).__name__}")])
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_pydantic_problems(exc)) from None
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(problems)
    return config


# Bounds on a config file (a hostile or broken file is refused, never crashes the loader).
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_CONFIG_DEPTH = 64  # nested mappings/sequences, aliases expanded
MAX_CONFIG_NODES = 1_000_000  # YAML nodes once every alias is expanded (alias bombs)


def _read_bytes(path: str | Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError([("", f"cannot read config file {str(path)!r}: {exc.strerror}")]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError([("", f"{path}: larger than {MAX_CONFIG_BYTES} bytes")])
    return raw


def _decode(path: str | Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError([("", f"{path}: not UTF-8: byte 0x{raw[exc.start]:02x} at offset "
                                f"{exc.start} (line {line})")]) from None


_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: faster


def _check_events(path: str | Path, text: str) -> None:
    """Nesting depth bounded before anything recursive (the composer) sees the document."""
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                mark = event.start_mark
                where = f" at line {mark.line + 1}" if mark is not None else ""
                raise ConfigError([("", f"{path}: nested deeper than {MAX_CONFIG_DEPTH} "
                                        f"levels{where}")])
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check_expansion(path: str | Path, root: yaml.Node) -> None:
    """Aliases expanded: at most MAX_CONFIG_DEPTH deep and MAX_CONFIG_NODES nodes in all;
    a recursive alias is refused."""
    measured: dict[int, tuple[int, int]] = {}  # node -> (expanded size, height)
    too_deep = ConfigError([("", f"{path}: aliases nest deeper than {MAX_CONFIG_DEPTH} levels")])

    def measure(node: yaml.Node, depth: int, open_ids: frozenset[int]) -> tuple[int, int]:
        if id(node) in open_ids:
            raise ConfigError([("", f"{path}: recursive YAML alias")])
        known = measured.get(id(node))
        if known is None:
            if depth > MAX_CONFIG_DEPTH:
                raise too_deep
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [part for pair in node.value for part in pair]
            inner = open_ids | {id(node)}
            parts = [measure(child, depth + 1, inner) for child in children]
            known = (1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0))
            measured[id(node)] = known
        if depth + known[1] > MAX_CONFIG_DEPTH + 1:
            raise too_deep
        if known[0] > MAX_CONFIG_NODES:
            raise ConfigError([("", f"{path}: more than {MAX_CONFIG_NODES} YAML nodes once "
                                    f"aliases are expanded")])
        return known

    measure(root, 0, frozenset())


def _yaml_problem(path: str | Path, exc: Exception) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    detail = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line
    return ConfigError([("", f"{path}: invalid YAML{where}: {detail}")])


def load_yaml_text(text: str, path: str | Path = "<config>") -> Any:
    """Parse YAML within the bounds above. Raises ConfigError, nothing else."""
    try:
        _check_events(path, text)
        loader = _LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(path, node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise _yaml_problem(path, exc) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # e.g. a huge int
        raise ConfigError([("", f"{path}: unusable YAML value: {type(exc).__name__}: "
                                f"{exc}")]) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file. Raises ConfigError naming what is wrong: an
    unreadable, oversized, non-UTF-8, too deeply nested or alias-bombed file included."""
    text = _decode(path, _read_bytes(path))
    return parse_config(load_yaml_text(text, path))
