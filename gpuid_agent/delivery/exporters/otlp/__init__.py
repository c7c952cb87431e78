"""The OTLP/HTTP log exporter; importing it loads `opentelemetry-proto`, so the factory does
only when `otlp` is chosen."""

from gpuid_agent.delivery.exporters.otlp.exporter import OtlpExporter

__all__ = ["OtlpExporter"]
