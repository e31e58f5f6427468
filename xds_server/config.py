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


class XdsConfig(_Addressed):
    address: str = "127.0.0.1:18000"


class AdminConfig(_Addressed):
    address: str = "127.0.0.1:19100"


class ListenerConfig(_Addressed):
    address: str = "0.0.0.0:10000"


class TelemetryConfig(_Model):
    interval_seconds: float = Field(2.0, gt=0)
    stale_after_seconds: float = Field(6.0, gt=0)
    timeout_seconds: float | None = Field(None, gt=0)
    max_concurrency: int = Field(64, ge=1)

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


class WeightsConfig(_Model):
    policy: Literal["gpu_memory"] = "gpu_memory"
    max_weight: int = Field(100, ge=1, le=128)


class EndpointConfig(_Addressed):
    metrics_url: str | None = None
    drain: bool = False

    @field_validator("metrics_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value

    @property
    def scrape_url(self) -> str:
        return self.metrics_url or f"http://{self.address}/metrics"


class PoolConfig(_Model):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    lb_policy: LbPolicy = "least_request"
    endpoints: list[EndpointConfig] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if any(ch.isspace() for ch in value) or value.startswith("trimtab-"):
            raise ValueError(f"expected a cluster name without spaces or the reserved "
                             f"'trimtab-' prefix, got {value!r}")
        return value


class Config(_Model):
    xds: XdsConfig = XdsConfig()
    admin: AdminConfig = AdminConfig()
    listener: ListenerConfig = ListenerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    weights: WeightsConfig = WeightsConfig()
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


def _cross_checks(config: Config) -> list[tuple[str, str]]:
    problems = []
    for index, first in _duplicates([p.name for p in config.pools]):
        problems.append((f"pools[{index}].name",
                         f"duplicate pool name {config.pools[index].name!r} (also pools[{first}])"))
    for index, first in _duplicates([p.model for p in config.pools]):
        problems.append((f"pools[{index}].model",
                         f"model {config.pools[index].model!r} is already served by pools[{first}]"))
    for p_index, pool in enumerate(config.pools):
        addresses = [str(e.host_port) for e in pool.endpoints]
        for index, first in _duplicates(addresses):
            problems.append((f"pools[{p_index}].endpoints[{index}].address",
                             f"duplicate endpoint address {addresses[index]!r} "
                             f"(also endpoints[{first}])"))
        for index, endpoint in enumerate(pool.endpoints):
            if not is_ip(endpoint.host_port.host):
                problems.append((f"pools[{p_index}].endpoints[{index}].address",
                                 f"expected an IP address (EDS endpoints are IPs), "
                                 f"got {endpoint.host_port.host!r}"))
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


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML config file. Raises ConfigError naming what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("", f"cannot read config file {str(path)!r}: {exc.strerror}")]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([("", f"{path}: invalid YAML{where}: "
                                f"{getattr(exc, 'problem', None) or exc}")]) from None
    return parse_config(data)
