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
import gzip
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import aiohttp
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, Record, excerpt
from gpuid_agent.delivery.exporters.otlp.encode import encode_logs
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.otel_env import logs_endpoint, parse_headers, parse_key_values
from gpuid_agent.runtime.retry import parse_retry_after

if TYPE_CHECKING:
    from prometheus_client import Counter

    from gpuid_agent.runtime.config import Settings
    from gpuid_agent.runtime.metrics import AgentMetrics

PROTOBUF = "application/x-protobuf"
USER_AGENT = f"gpuid-agent/{__version__}"
RETRYABLE = frozenset({429, 502, 503, 504})  # the OTLP/HTTP specification's list
_OFF_LOOP_RECORDS = 500  # encode and compress bigger batches in a worker thread

_log = log.get("otlp")


class OtlpExporter(Exporter):
    name = "otlp"

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
        self.endpoint = endpoint
        self.timeout = timeout
        self.gzip_body = compression == "gzip"
        self.ca_file = ca_file
        self._headers = dict(headers or {})
        self._resource = dict(resource_attributes or {})
        self._session: aiohttp.ClientSession | None = None
        self._rejected: Counter | None = None
        self.rejected_records = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> OtlpExporter:
        """The logs signal's settings win over the general ones; headers of both apply."""
        headers = parse_headers(settings.otel_exporter_otlp_headers.get_secret_value())
        headers.update(parse_headers(settings.otel_exporter_otlp_logs_headers.get_secret_value()))
        timeout_ms = settings.otel_exporter_otlp_logs_timeout or settings.otel_exporter_otlp_timeout
        return cls(
            logs_endpoint(
                settings.otel_exporter_otlp_endpoint, settings.otel_exporter_otlp_logs_endpoint
            ),
            headers=headers,
            timeout=timeout_ms / 1000.0,
            compression=settings.otel_exporter_otlp_logs_compression
            or settings.otel_exporter_otlp_compression,
            ca_file=settings.otel_exporter_otlp_logs_certificate
            or settings.otel_exporter_otlp_certificate,
            resource_attributes=parse_key_values(settings.otel_resource_attributes),
        )

    def bind_metrics(self, metrics: AgentMetrics) -> None:
        self._rejected = metrics.export_rejected_records.labels(self.name)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self.ca_file:
                ssl_context = ssl.create_default_context(cafile=self.ca_file)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context, limit=4),
                headers={"User-Agent": USER_AGENT},
            )
        return self._session

    def body(self, batch: Sequence[Record]) -> bytes:
        """The request body: the encoded batch, gzipped when compression is on."""
        raw = encode_logs(batch, self._resource).SerializeToString()
        return gzip.compress(raw, 6) if self.gzip_body else raw

    async def export(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> None:
        meta = meta or BatchMeta.new()
        if len(batch) > _OFF_LOOP_RECORDS:
            body = await asyncio.to_thread(self.body, batch)
        else:
            body = self.body(batch)
        headers = {
            **self._headers,
            "Content-Type": PROTOBUF,
            # not part of OTLP; lets a gateway in front of the collector drop a re-sent batch
            "Idempotency-Key": meta.batch_id,
        }
        if self.gzip_body:
            headers["Content-Encoding"] = "gzip"
        try:
            async with self._client().post(
                self.endpoint,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                allow_redirects=False,  # a redirected POST would silently become a GET
            ) as response:
                status = response.status
                answer = await response.read()
                protobuf = response.content_type == PROTOBUF
                retry_after = parse_retry_after(response.headers.get("Retry-After"))
        except aiohttp.ClientSSLError as exc:
            raise ExportError(f"TLS error: {exc}", error_type="tls") from exc
        except TimeoutError as exc:
            raise ExportError(f"no answer within {self.timeout}s", error_type="timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ExportError(f"connection failed: {exc}", error_type="connection") from exc
        if 200 <= status < 300:
            if protobuf:  # an answer in another format carries nothing we read
                self._partial_success(answer, meta, len(batch))
            return
        text = excerpt(answer.decode("utf-8", "replace"), *self._headers.values())
        message = f"HTTP {status}: {text}" if text else f"HTTP {status}"
        retryable = status in RETRYABLE or 300 <= status < 400
        raise ExportError(
            message, error_type=f"http_{status}", retryable=retryable, retry_after=retry_after
        )

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

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
