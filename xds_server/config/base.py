"""What every config section shares: a frozen model that refuses unknown keys, and the
address-carrying variant."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from xds_server.config.addresses import HostPort, parse_host_port

SourceName = Literal["scrape", "prometheus", "static", "file"]  # where telemetry comes from


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Addressed(Model):
    address: str

    @field_validator("address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @property
    def host_port(self) -> HostPort:
        return parse_host_port(self.address)
