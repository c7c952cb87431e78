"""The /gpu/metrics families to an OTLP `ExportMetricsServiceRequest`.

Names, labels and values stay those of /gpu/metrics, so one query works on either path:
gauges and info families become OTLP Gauges, counters cumulative monotonic Sums (named
without `_total`, which OpenTelemetry's Prometheus exporters add back); labels become data
point attributes (empty ones left out, as Prometheus treats them as absent).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.otlp.attributes import SCOPE_NAME
from gpuid_agent.delivery.exporters.otlp.logs_encoding import add_attributes, utf8

_CUMULATIVE = AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


class MetricFamily(Protocol):
    """What is read of a /gpu/metrics family: a counter's name is without `_total`."""

    @property
    def name(self) -> str: ...
    @property
    def help(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def labelnames(self) -> tuple[str, ...]: ...
    @property
    def rows(self) -> Sequence[tuple[tuple[str, ...], float]]: ...


def encode_metrics(
    families: Iterable[MetricFamily],
    resource: Mapping[str, str],
    time_unix_nano: int,
    start_time_unix_nano: int,
) -> ExportMetricsServiceRequest:
    """One request with every sample of `families` as a data point at `time_unix_nano`;
    counters count from `start_time_unix_nano` (when the agent started)."""
    request = ExportMetricsServiceRequest()
    resource_metrics = request.resource_metrics.add()
    add_attributes(resource_metrics.resource.attributes, resource)
    scope_metrics = resource_metrics.scope_metrics.add()
    scope_metrics.scope.name = SCOPE_NAME
    scope_metrics.scope.version = __version__
    for family in families:
        if not family.rows:
            continue
        counter = family.type == "counter"
        metric = scope_metrics.metrics.add()
        metric.name = family.name
        metric.description = utf8(family.help)
        if counter:
            metric.sum.aggregation_temporality = _CUMULATIVE
            metric.sum.is_monotonic = True
            points = metric.sum.data_points
        else:
            points = metric.gauge.data_points
        names = family.labelnames
        for values, value in family.rows:
            point = points.add()
            point.time_unix_nano = time_unix_nano
            if counter:
                point.start_time_unix_nano = start_time_unix_nano
            point.as_double = float(value)
            add_attributes(point.attributes, dict(zip(names, values, strict=True)))
    return request
