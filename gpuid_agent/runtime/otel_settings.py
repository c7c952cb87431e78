"""OpenTelemetry's exporter variables, by their standard names (OTEL_EXPORTER_OTLP_*).

The logs (`_LOGS_`) and metrics (`_METRICS_`) variants win over the general ones. Kept apart
from the agent's own settings so `config.py` stays one screenful per concern.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings

from gpuid_agent.runtime.otel_env import URL, parse_headers, parse_key_values


class OtelSettings(BaseSettings):
    """The OTLP exporter's settings; `Settings` inherits them."""

    otel_exporter_otlp_endpoint: str = Field(
        "", description="OTLP/HTTP base URL; logs go to its path + /v1/logs."
    )
    otel_exporter_otlp_logs_endpoint: str = Field("", description="OTLP/HTTP logs URL, as is.")
    otel_exporter_otlp_headers: SecretStr = Field(
        SecretStr(""), description="Request headers k=v,k2=v2, values URL-encoded (secret)."
    )
    otel_exporter_otlp_logs_headers: SecretStr = Field(
        SecretStr(""), description="Request headers of log exports, added to the general ones."
    )
    otel_exporter_otlp_timeout: int = Field(
        10_000, ge=1, le=600_000, description="One request's timeout in milliseconds."
    )
    otel_exporter_otlp_logs_timeout: int | None = Field(
        None, ge=1, le=600_000, description="Log requests' timeout in milliseconds."
    )
    otel_exporter_otlp_compression: Literal["gzip", "none"] = Field(
        "gzip", description="Request body compression."
    )
    otel_exporter_otlp_logs_compression: Literal["", "gzip", "none"] = Field(
        "", description="Log requests' compression (empty: the general one)."
    )
    otel_exporter_otlp_protocol: Literal["http/protobuf"] = Field(
        "http/protobuf", description="OTLP transport; only http/protobuf is spoken."
    )
    otel_exporter_otlp_logs_protocol: Literal["", "http/protobuf"] = Field(
        "", description="OTLP transport of logs; only http/protobuf is spoken."
    )
    otel_exporter_otlp_certificate: str = Field(
        "", description="PEM file of CAs to trust for the OTLP endpoint."
    )
    otel_exporter_otlp_logs_certificate: str = Field(
        "", description="PEM file of CAs to trust for the logs endpoint."
    )
    otel_resource_attributes: str = Field(
        "", description="Extra resource attributes k=v,k2=v2 on exported logs."
    )

    otel_metrics_exporter: Literal["none", "otlp"] = Field(
        "none",
        description="otlp: also push the /gpu/metrics telemetry as OTLP metrics "
        "(to OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else the base + /v1/metrics).",
    )
    otel_exporter_otlp_metrics_endpoint: str = Field(
        "", description="OTLP/HTTP metrics URL, as is."
    )
    otel_metric_export_interval: int = Field(
        60_000, ge=100, le=86_400_000, description="Metrics push period in milliseconds."
    )

    def otel_problems(self, logs_chosen: bool) -> dict[str, str]:
        """Problems of these settings by variable name; header values are never quoted back
        (they hold credentials)."""
        problems: dict[str, str] = {}
        urls = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.otel_exporter_otlp_endpoint,
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": self.otel_exporter_otlp_logs_endpoint,
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": self.otel_exporter_otlp_metrics_endpoint,
        }
        for name, url in urls.items():
            if url and not URL.fullmatch(url):
                problems[name] = "must be an http:// or https:// URL"
        base = self.otel_exporter_otlp_endpoint
        if logs_chosen and not (base or self.otel_exporter_otlp_logs_endpoint):
            problems["OTEL_EXPORTER_OTLP_ENDPOINT"] = (
                "required when EXPORTER_TYPE includes otlp "
                "(or OTEL_EXPORTER_OTLP_LOGS_ENDPOINT, used as is)"
            )
        if self.otel_metrics_exporter == "otlp" and not (
            base or self.otel_exporter_otlp_metrics_endpoint
        ):
            problems["OTEL_EXPORTER_OTLP_ENDPOINT"] = (
                "required when OTEL_METRICS_EXPORTER=otlp "
                "(or OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, used as is)"
            )
        for name, secret in (
            ("OTEL_EXPORTER_OTLP_HEADERS", self.otel_exporter_otlp_headers),
            ("OTEL_EXPORTER_OTLP_LOGS_HEADERS", self.otel_exporter_otlp_logs_headers),
        ):
            try:
                parse_headers(secret.get_secret_value())
            except ValueError as exc:
                problems[name] = str(exc)
        try:
            parse_key_values(self.otel_resource_attributes)
        except ValueError as exc:
            problems["OTEL_RESOURCE_ATTRIBUTES"] = str(exc)
        return problems
