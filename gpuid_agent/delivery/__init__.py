"""Delivery: typed records fanned out to one worker per exporter (intake, store, sender,
health), so one failing sink fails alone. The exporters themselves are imported only when
chosen (`setup.delivery`)."""

from gpuid_agent.delivery.pipeline import Pipeline, build_pipeline
from gpuid_agent.delivery.policy import BatchPolicy
from gpuid_agent.delivery.worker import ExporterWorker

__all__ = ["BatchPolicy", "ExporterWorker", "Pipeline", "build_pipeline"]
