"""A pool's config: its endpoints (or stable/canary versions), routing, resilience and
request classes, and which other pools it sends traffic to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import Addressed, Model, SourceName

if TYPE_CHECKING:
    from xds_server.config.schema import Config

LbPolicy = Literal["round_robin", "least_request", "ring_hash", "maglev", "random"]
LB_POLICIES: tuple[str, ...] = ("round_robin", "least_request", "ring_hash", "maglev", "random")


class NumberRangeConfig(Model):
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


class RequestClassConfig(Model):
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


class StaticResponseConfig(Model):
    """What a client gets instead of a 503 when this pool (and its fallback) has no healthy
    host: the seed's StaticResponse fallback."""

    status: int = Field(200, ge=200, le=599)
    body: str = Field(min_length=1, max_length=64 * 1024)
    content_type: str = Field("application/json", min_length=1, max_length=256)


class ModelVersionsConfig(Model):
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


class EndpointConfig(Addressed):
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


class PromptClassConfig(Model):
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


class VersionConfig(Model):
    endpoints: list[EndpointConfig] = Field(min_length=1)


class GateConfig(Model):
    """SLO gates: the canary may be at most this much worse than stable."""

    ttft_p95_tolerance: float = Field(0.20, ge=0)   # relative: 0.2 = 20 % slower allowed
    itl_p95_tolerance: float = Field(0.20, ge=0)
    error_rate_tolerance: float = Field(0.01, ge=0)  # absolute: 0.01 = one point more errors
    min_requests: int = Field(20, ge=1)             # per version per step before judging


class RolloutConfig(Model):
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


class RetryConfig(Model):
    retry_on: list[str] = ["connect-failure", "reset", "retriable-status-codes"]
    retriable_status_codes: list[int] = [503]
    num_retries: int = Field(2, ge=0, le=10)
    per_try_timeout_seconds: float = Field(0.0, ge=0)  # 0: none (streams are long)
    budget_percent: float = Field(20.0, gt=0, le=100)  # Envoy retry budget
    min_retry_concurrency: int = Field(3, ge=0)


class CircuitBreakerConfig(Model):
    max_connections: int = Field(100_000, ge=1)
    max_pending_requests: int = Field(100_000, ge=1)
    max_requests: int = Field(100_000, ge=1)


class SloConfig(Model):
    """The pool's service-level objective; with ``ttft_seconds`` set, admission is on."""

    ttft_seconds: float | None = Field(None, gt=0, le=3600)


class AdmissionConfig(Model):
    """How the admission budget (from ``slo.ttft_seconds``) is enforced: Envoy's circuit
    breakers, set at run time over RTDS, and with ``tenant_header`` a per-tenant token bucket
    (xds_server/envoy/admission.py)."""

    enabled: bool = True
    wait_fraction: float = Field(0.75, gt=0, le=1)  # of the SLO a request may wait queued
    priority_header: str = Field("x-priority", min_length=1, max_length=128)
    default_priority: Literal["interactive", "batch"] = "interactive"
    batch_share: float = Field(0.5, gt=0, le=1)  # of the budget batch requests may hold
    envoys: int | None = Field(None, ge=1, le=100_000)  # None: counted from the xDS streams
    # a pool with a `fallback`: while over its budget, send a share of new requests there
    spill_to_fallback: bool = True
    # tenant fairness (xds_server/envoy/admission.py): one token bucket per value of this
    # header, enforced only while the pool is pressed; None: off
    tenant_header: str | None = Field(None, min_length=1, max_length=128,
                                      pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    max_tenants: int = Field(10_000, ge=1, le=100_000)  # buckets per route, least recent dropped


class OutlierDetectionConfig(Model):
    enabled: bool = True
    consecutive_5xx: int = Field(5, ge=1)
    interval_seconds: float = Field(5.0, gt=0)
    base_ejection_seconds: float = Field(30.0, gt=0)
    max_ejection_percent: int = Field(50, ge=0, le=100)


class TimeoutConfig(Model):
    connect_seconds: float = Field(2.0, gt=0)
    request_seconds: float = Field(0.0, ge=0)  # 0: no overall limit: LLM streams run for minutes
    idle_seconds: float = Field(300.0, gt=0)   # a stream silent this long is closed


class SlowStartConfig(Model):
    window_seconds: float = Field(30.0, gt=0)
    aggression: float = Field(1.0, gt=0)
    min_weight_percent: float = Field(10.0, ge=0, le=100)


class AffinityConfig(Model):
    header: str = Field(min_length=1)
    hash: Literal["ring_hash", "maglev"] = "ring_hash"


class HealthCheckConfig(Model):
    path: str = "/health"
    interval_seconds: float = Field(1.0, gt=0)
    timeout_seconds: float = Field(1.0, gt=0)
    unhealthy_threshold: int = Field(2, ge=1)
    healthy_threshold: int = Field(1, ge=1)


class ScalingConfig(Model):
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


class KubernetesDiscoveryConfig(Model):
    """Where a pool's endpoints come from: a Service's EndpointSlices (``service``) or a
    Gateway API Inference Extension InferencePool's selected pods (``inference_pool``,
    ``inference.networking.k8s.io/v1``), exactly one of the two, in ``namespace``."""

    namespace: str = Field(min_length=1, max_length=63)
    service: str | None = Field(None, min_length=1, max_length=253)
    inference_pool: str | None = Field(None, min_length=1, max_length=253)
    port_name: str | None = None        # the EndpointSlice port; default: the only port
    api_server: str | None = None       # default: in-cluster service account, else kubeconfig

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesDiscoveryConfig:
        if (self.service is None) == (self.inference_pool is None):
            raise ValueError("set exactly one of `service` (EndpointSlices) and "
                             "`inference_pool` (an InferencePool's pods)")
        if self.inference_pool is not None and self.port_name is not None:
            raise ValueError("`port_name` names an EndpointSlice port; an InferencePool's "
                             "ports are its spec.targetPorts")
        return self


class DiscoveryConfig(Model):
    kubernetes: KubernetesDiscoveryConfig


class PoolConfig(Model):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    # least_request on the queueing weights measured best (docs/results/weights.md)
    lb_policy: LbPolicy = "least_request"
    # least_request only: Envoy divides each weight by (active + 1) ** bias (default 1.0)
    active_request_bias: float | None = Field(None, ge=0, le=100)
    # least_request only: among hosts of equal weight (a capacity tier), Envoy draws this many
    # at random and takes the one with the fewest active requests (Envoy's default 2; with
    # replacement, so 2 draws from a pair of twins are the same host half the time)
    choice_count: int = Field(8, ge=2, le=1000)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    versions: dict[Literal["stable", "canary"], VersionConfig] | None = None
    rollout: RolloutConfig | None = None
    # "auto": classes derived from the endpoints' KV capacities (xds_server/envoy/prompt_classes.py)
    long_context: PromptClassConfig | Literal["auto"] | None = None
    prompt_classes: list[PromptClassConfig] = Field(default_factory=list)
    fallback: str | None = None
    retry_policy: RetryConfig = RetryConfig()
    circuit_breakers: CircuitBreakerConfig = CircuitBreakerConfig()
    slo: SloConfig = SloConfig()
    admission: AdmissionConfig = AdmissionConfig()
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    slow_start: SlowStartConfig | None = None
    warmup_weight: int = Field(10, ge=1)
    affinity: AffinityConfig | None = None
    health_check: HealthCheckConfig | None = None
    scaling: ScalingConfig | None = None
    discovery: DiscoveryConfig | None = None    # EndpointSlices or an InferencePool
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
    def admits(self) -> bool:
        """Admission control is on: an SLO to keep and not switched off."""
        return self.slo.ttft_seconds is not None and self.admission.enabled

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

    def request_targets(self) -> set[str]:
        """Pools this pool sends requests to through its request classes, model versions
        and intent tiers."""
        versions = set(self.model_versions.pools.values()) if self.model_versions else set()
        tiers = set((self.intent_tiers or {}).values())
        return {cls.pool for cls in self.request_classes} | versions | tiers

    def dependencies(self) -> set[str]:
        """Every other pool this pool may send traffic to: fallback, prompt-size classes and
        request targets (a node given this pool needs those too)."""
        deps = {size.pool for size in self.size_classes()} | self.request_targets()
        if self.fallback is not None:
            deps.add(self.fallback)
        return deps - {self.name}
