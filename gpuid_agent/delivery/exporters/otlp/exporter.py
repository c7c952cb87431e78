"""POST each batch as an OTLP `ExportLogsServiceRequest` (protobuf, gzip) over OTLP/HTTP.

Answers follow the OTLP/HTTP specification: 429, 502, 503 and 504 (and connection errors,
timeouts, redirects to fix the endpoint for) are retried by the worker's one backoff, which
honours Retry-After; every other 4xx and 5xx means the receiver will never take this request,
so the batch is set aside. A 2xx may carry a partial success: the records the receiver
declined are counted (`gpuid_export_rejected_records_total`) and logged once per batch, and
the batch counts as delivered (re-sending it cannot change the receiver's mind).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

from gpuid_agent.delivery.exporters.base import (
    BatchMeta,
    Exporter,
    ExporterHealth,
    JoinLimits,
    excerpt,
)
from gpuid_agent.delivery.exporters.otlp.endpoint import OtlpEndpoint
from gpuid_agent.delivery.exporters.otlp.logs_encoding import encode_logs
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log

if TYPE_CHECKING:
    from prometheus_client import Counter

    from gpuid_agent.runtime.metrics import AgentMetrics

_OFF_LOOP_RECORDS = 500  # encode and compress bigger batches in a worker thread

_log = log.get("otlp")


class OtlpExporter(Exporter):
    name = "otlp"
    # A backlog goes out up to 1,000 records a request (about 0.5 MB of protobuf for
    # readings, well under the request limits collectors set by default).
    joins = JoinLimits(1_000, 4 * 1024 * 1024)

    def __init__(
        self,
        endpoint: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        compression: str = "gzip",
        ca_file: str = "",
        resource_attributes: Mapping[str, str] | None = None,
    ) -> None:
        self.http = OtlpEndpoint(
            endpoint, headers=headers, timeout=timeout, compression=compression, ca_file=ca_file
        )
        self._resource = dict(resource_attributes or {})
        self._rejected: Counter | None = None
        self.rejected_records = 0

    @property
    def endpoint(self) -> str:
        return self.http.endpoint

    def bind_metrics(self, metrics: AgentMetrics) -> None:
        self._rejected = metrics.export_rejected_records.labels(self.name)

    def body(self, batch: Sequence[AnyRecord]) -> bytes:
        """The request body: the encoded batch, gzipped when compression is on."""
        return self.http.compress(encode_logs(batch, self._resource).SerializeToString())

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        meta = meta or BatchMeta.new()
        if len(batch) > _OFF_LOOP_RECORDS:
            body = await asyncio.to_thread(self.body, batch)
        else:
            body = self.body(batch)
        # Idempotency-Key is not part of OTLP; it lets a gateway in front of the collector
        # drop a re-sent batch.
        answer = await self.http.post(body, {"Idempotency-Key": meta.batch_id})
        self._partial_success(answer, meta, len(batch))

    def _partial_success(self, answer: bytes, meta: BatchMeta, sent: int) -> None:
        """Count and log what a 2xx answer says the receiver declined."""
        if not answer:
            return
        response = ExportLogsServiceResponse()
        try:
            response.ParseFromString(answer)
        except DecodeError:
            _log.warning(
                "OTLP answer unreadable; batch counted as delivered",
                extra={"exporter": self.name, "batch_id": meta.batch_id, "bytes": len(answer)},
            )
            return
        rejected = response.partial_success.rejected_log_records
        if rejected <= 0 and not response.partial_success.error_message:
            return
        if rejected > 0:
            self.rejected_records += rejected
            if self._rejected is not None:
                self._rejected.inc(rejected)
        _log.warning(
            "OTLP receiver declined records of a batch" if rejected > 0 else "OTLP receiver warns",
            extra={
                "exporter": self.name,
                "batch_id": meta.batch_id,
                "rejected": rejected,
                "records": sent,
                "reason": excerpt(response.partial_success.error_message),
            },
        )

    async def health(self) -> ExporterHealth:
        # No probe request: an OTLP receiver answers POSTs only, and an empty export would be
        # counted by it. Deliveries are this exporter's health; here only the CA file.
        ca_file = self.http.ca_file
        if ca_file and not await asyncio.to_thread(os.access, ca_file, os.R_OK):
            return ExporterHealth(ok=False, reason=f"CA bundle {ca_file} unreadable")
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        await self.http.close()
