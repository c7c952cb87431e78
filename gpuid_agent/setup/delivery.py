"""Delivery from Settings: the exporters named in EXPORTER_TYPE with their own settings, the
pipeline that drives them, and the OTLP metrics push when OTEL_METRICS_EXPORTER asks for it.

Each exporter module is imported only when chosen, so an unused exporter's client library
(asyncpg, aiobotocore, opentelemetry-proto) is never loaded. Secret settings leave their
SecretStr only here, straight into the exporter that sends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.pipeline import BatchPolicy, Pipeline, build_pipeline
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.otel_env import (
    logs_endpoint,
    parse_headers,
    parse_key_values,
    signal_endpoint,
)

if TYPE_CHECKING:
    from gpuid_agent.delivery.otlp_metrics import Families, OtlpMetricsPush


def _http(s: Settings) -> Exporter:
    from gpuid_agent.delivery.exporters.http import HttpExporter

    return HttpExporter(
        s.http_endpoint,
        timeout=s.http_timeout,
        token=s.http_auth_token.get_secret_value(),
        token_file=s.http_auth_token_file,
        gzip_body=s.http_gzip,
        ca_bundle=s.http_ca_bundle,
    )


def _postgres(s: Settings) -> Exporter:
    from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables

    return PostgresExporter(
        host=s.postgres_host,
        port=s.postgres_port,
        database=s.postgres_db,
        user=s.postgres_user,
        password=s.postgres_password.get_secret_value(),
        sslmode=s.postgres_sslmode,
        tables=Tables.named(
            s.postgres_table, s.postgres_allocations_table, s.postgres_events_table
        ),
        auto_migrate=s.postgres_auto_migrate,
        timeout=s.timeout,
        idle_timeout=s.postgres_idle_timeout,
        # which node holds a connection, for whoever reads pg_stat_activity
        application_name=f"gpuid-agent {s.effective_node_name()}",
    )


def _s3(s: Settings) -> Exporter:
    from gpuid_agent.delivery.exporters.s3 import S3Exporter

    return S3Exporter(
        s.s3_bucket,
        prefix=s.s3_prefix,
        region=s.s3_region,
        partition_pattern=s.s3_partition_pattern,
        endpoint_url=s.s3_endpoint_url,
        path_style=s.s3_path_style,
        fmt=s.s3_format,
        csv_header=s.s3_csv_header,
        gzip_objects=s.s3_gzip,
        timeout=s.timeout,
    )


def _otlp(s: Settings) -> Exporter:
    """The logs signal's settings win over the general ones; headers of both apply."""
    from gpuid_agent.delivery.exporters.otlp import OtlpExporter

    headers = parse_headers(s.otel_exporter_otlp_headers.get_secret_value())
    headers.update(parse_headers(s.otel_exporter_otlp_logs_headers.get_secret_value()))
    timeout_ms = s.otel_exporter_otlp_logs_timeout or s.otel_exporter_otlp_timeout
    return OtlpExporter(
        logs_endpoint(s.otel_exporter_otlp_endpoint, s.otel_exporter_otlp_logs_endpoint),
        headers=headers,
        timeout=timeout_ms / 1000.0,
        compression=s.otel_exporter_otlp_logs_compression or s.otel_exporter_otlp_compression,
        ca_file=s.otel_exporter_otlp_logs_certificate or s.otel_exporter_otlp_certificate,
        resource_attributes=parse_key_values(s.otel_resource_attributes),
    )


def _stdout(_s: Settings) -> Exporter:
    from gpuid_agent.delivery.exporters.stdout import StdoutExporter

    return StdoutExporter()


_BUILDERS = {"stdout": _stdout, "http": _http, "postgres": _postgres, "s3": _s3, "otlp": _otlp}


def make_exporters(settings: Settings) -> list[Exporter]:
    """The exporters EXPORTER_TYPE names, in its order."""
    return [_BUILDERS[name](settings) for name in settings.exporter_type]


def build_delivery(
    settings: Settings, metrics: AgentMetrics, exporters: Sequence[Exporter] | None = None
) -> Pipeline:
    """One worker per exporter, with its spool; `exporters` replaces the configured ones."""
    policy = BatchPolicy(
        batch_size=settings.batch_size,
        flush_interval=settings.flush_interval,
        queue_size=settings.queue_size,
        retry_count=settings.retry_count,
        timeout=settings.timeout,
        backoff_base=settings.retry_backoff,
        backoff_max=settings.retry_backoff_max,
        health_probe_interval=settings.health_probe_interval,
    )
    chosen = list(exporters) if exporters is not None else make_exporters(settings)
    return build_pipeline(
        chosen,
        policy,
        metrics,
        spool_dir=settings.spool_dir,
        spool_max_bytes=settings.spool_max_bytes,
    )


def otlp_metrics_push(
    settings: Settings, families: Families, metrics: AgentMetrics
) -> OtlpMetricsPush | None:
    """The push of `families` as OTLP metrics, or None unless OTEL_METRICS_EXPORTER=otlp (only
    then is opentelemetry-proto loaded). The metrics signal's endpoint, the general rest."""
    s = settings
    if s.otel_metrics_exporter != "otlp":
        return None
    from gpuid_agent.delivery.exporters.otlp.endpoint import OtlpEndpoint
    from gpuid_agent.delivery.otlp_metrics import OtlpMetricsPush

    endpoint = OtlpEndpoint(
        signal_endpoint(
            s.otel_exporter_otlp_endpoint, s.otel_exporter_otlp_metrics_endpoint, "metrics"
        ),
        headers=parse_headers(s.otel_exporter_otlp_headers.get_secret_value()),
        timeout=s.otel_exporter_otlp_timeout / 1000.0,
        compression=s.otel_exporter_otlp_compression,
        ca_file=s.otel_exporter_otlp_certificate,
    )
    return OtlpMetricsPush(
        endpoint,
        families,
        metrics,
        interval=s.otel_metric_export_interval / 1000.0,
        resource_attributes=parse_key_values(s.otel_resource_attributes),
    )
