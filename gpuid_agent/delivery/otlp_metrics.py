"""The /gpu/metrics telemetry pushed as OTLP metrics (`OTEL_METRICS_EXPORTER=otlp`).

Every `OTEL_METRIC_EXPORT_INTERVAL` the newest snapshot's families — the very ones
/gpu/metrics serves — go out as one `ExportMetricsServiceRequest`, and once more when the bus
closes at shutdown. Telemetry is a current value, not a record: nothing is spooled or retried
within an interval; a failed push is counted and logged (once per outage) and the next one
carries fresh values. A Retry-After from the receiver skips pushes until it has passed.

The families come from the wiring root (the renderer's, so delivery never imports serving),
and so does the endpoint with the settings of the metrics signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)

from gpuid_agent.delivery.exporters.base import excerpt
from gpuid_agent.delivery.exporters.otlp.endpoint import OtlpEndpoint
from gpuid_agent.delivery.exporters.otlp.logs_encoding import resource
from gpuid_agent.delivery.exporters.otlp.metrics_encoding import MetricFamily, encode_metrics
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

NAME = "otlp_metrics"  # the `exporter` label of its success and failure counters
_log = log.get("otlp")

Families = Callable[[NodeSnapshot], Sequence[MetricFamily]]


class OtlpMetricsPush:
    def __init__(
        self,
        endpoint: OtlpEndpoint,
        families: Families,
        metrics: AgentMetrics,
        *,
        interval: float,
        resource_attributes: Mapping[str, str] | None = None,
    ) -> None:
        self.http = endpoint
        self.interval = interval  # seconds
        self._families = families
        self._extra_resource = dict(resource_attributes or {})
        self._metrics = metrics
        self._started_ns = time.time_ns()
        self._latest: NodeSnapshot | None = None
        self._quiet_until = 0.0  # a receiver's Retry-After
        self.failures = 0  # consecutive
        self.pushes = 0

    def _note(self, snapshot: NodeSnapshot) -> None:
        self._latest = snapshot

    def body(self, snapshot: NodeSnapshot, now_ns: int) -> bytes:
        inventory = snapshot.inventory
        request = encode_metrics(
            self._families(snapshot),
            resource((inventory.cluster, inventory.node, inventory.machine), self._extra_resource),
            now_ns,
            self._started_ns,
        )
        return self.http.compress(request.SerializeToString())

    async def push(self) -> bool:
        """Send the newest snapshot's telemetry now; False if there was none or it failed."""
        snapshot = self._latest
        if snapshot is None or time.monotonic() < self._quiet_until:
            return False
        body = await asyncio.to_thread(self.body, snapshot, time.time_ns())
        try:
            answer = await self.http.post(body)
        except ExportError as exc:
            self._failed(exc)
            return False
        if self.failures:
            _log.info("OTLP metrics push works again", extra={"failed_pushes": self.failures})
        self.failures = 0
        self.pushes += 1
        self._metrics.export_success.labels(NAME).inc()
        self._partial_success(answer)
        return True

    def _failed(self, exc: ExportError) -> None:
        self.failures += 1
        self._metrics.export_failure.labels(NAME, exc.error_type).inc()
        if exc.retry_after:
            self._quiet_until = time.monotonic() + exc.retry_after
        _log.log(
            30 if self.failures == 1 else 10,
            "OTLP metrics push failed",
            extra={"exporter": NAME, "error_type": exc.error_type, "error": str(exc)},
        )

    def _partial_success(self, answer: bytes) -> None:
        response = ExportMetricsServiceResponse()
        try:
            response.ParseFromString(answer)
        except DecodeError:
            return
        rejected = response.partial_success.rejected_data_points
        if rejected > 0:
            self._metrics.export_rejected_records.labels(NAME).inc(rejected)
            _log.warning(
                "OTLP receiver declined data points",
                extra={
                    "exporter": NAME,
                    "rejected": rejected,
                    "reason": excerpt(response.partial_success.error_message),
                },
            )

    async def run(self, subscription: Subscription) -> None:
        """Push every interval until the bus closes, then push the last snapshot once."""
        follower = asyncio.create_task(subscription.feed(self._note))
        try:
            while not follower.done():
                await asyncio.wait({follower}, timeout=self.interval)
                await self.push()
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def close(self) -> None:
        await self.http.close()
