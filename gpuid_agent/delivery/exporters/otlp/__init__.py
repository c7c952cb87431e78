"""The OTLP/HTTP log exporter; importing it loads `opentelemetry-proto`, so the wiring
(`setup.delivery`) does only when `otlp` is chosen."""

from gpuid_agent.delivery.exporters.otlp.exporter import OtlpExporter

__all__ = ["OtlpExporter"]
