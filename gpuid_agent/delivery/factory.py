"""The configured delivery: one worker per exporter named in EXPORTER_TYPE, with its spool."""

from __future__ import annotations

from collections.abc import Sequence

from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.pipeline import BatchPolicy, Pipeline, build_pipeline
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.metrics import AgentMetrics


def make_exporters(settings: Settings) -> list[Exporter]:
    """The configured exporters; each module is imported only when chosen, so an unused
    exporter's client library (asyncpg, aiobotocore, opentelemetry-proto) is never loaded."""
    exporters: list[Exporter] = []
    for name in settings.exporter_type:
        if name == "stdout":
            from gpuid_agent.delivery.exporters.stdout import StdoutExporter

            exporters.append(StdoutExporter())
        elif name == "http":
            from gpuid_agent.delivery.exporters.http import HttpExporter

            exporters.append(HttpExporter.from_settings(settings))
        elif name == "postgres":
            from gpuid_agent.delivery.exporters.postgres import PostgresExporter

            exporters.append(PostgresExporter.from_settings(settings))
        elif name == "s3":
            from gpuid_agent.delivery.exporters.s3 import S3Exporter

            exporters.append(S3Exporter.from_settings(settings))
        elif name == "otlp":
            from gpuid_agent.delivery.exporters.otlp import OtlpExporter

            exporters.append(OtlpExporter.from_settings(settings))
        else:  # pragma: no cover - config validation admits only the names above
            raise ValueError(f"unknown exporter {name}")
    return exporters


def build_delivery(
    settings: Settings, metrics: AgentMetrics, exporters: Sequence[Exporter] | None = None
) -> Pipeline:
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
