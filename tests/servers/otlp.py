"""An OTLP/HTTP logs receiver in aiohttp that decodes what a collector would, with the same
`opentelemetry-proto` wire types, and answers as a collector does.

It takes `POST /v1/logs` with `Content-Type: application/x-protobuf` (gzip or not), answers a
body it cannot decode with 400 and a `google.rpc.Status`-shaped message, a wrong content type
with 415, and otherwise with an `ExportLogsServiceResponse` — empty, or a partial success or a
503 + Retry-After when a test plans one. Decoded log records are kept flattened, with their
resource and scope, so tests read them as plain dicts.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import signal
import ssl
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aiohttp import web
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PROTOBUF = "application/x-protobuf"


def any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which) if which else None


def attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        kv: KeyValue = pair
        if kv.key in out:
            raise ValueError(f"duplicate attribute key {kv.key}")
        out[kv.key] = any_value(kv.value)
    return out


@dataclass(frozen=True)
class Log:
    """One decoded LogRecord with what encloses it."""

    resource: dict[str, Any]
    scope: tuple[str, str]
    attributes: dict[str, Any]
    body: Any
    time_unix_nano: int
    observed_time_unix_nano: int
    severity_number: int
    severity_text: str
    event_name: str

    @property
    def record(self) -> dict[str, Any]:
        """The body: the agent's record as JSON."""
        return dict(json.loads(self.body))


def flatten(request: ExportLogsServiceRequest) -> list[Log]:
    out: list[Log] = []
    for resource_logs in request.resource_logs:
        resource = attributes(resource_logs.resource.attributes)
        for scope_logs in resource_logs.scope_logs:
            scope = (scope_logs.scope.name, scope_logs.scope.version)
            for record in scope_logs.log_records:
                out.append(
                    Log(
                        resource,
                        scope,
                        attributes(record.attributes),
                        any_value(record.body),
                        record.time_unix_nano,
                        record.observed_time_unix_nano,
                        int(record.severity_number),
                        record.severity_text,
                        record.event_name,
                    )
                )
    return out


@dataclass(frozen=True)
class Point:
    """One decoded metric data point with its metric and resource."""

    resource: dict[str, Any]
    name: str
    kind: str  # gauge or sum
    unit: str
    attributes: dict[str, Any]
    value: float
    time_unix_nano: int
    start_time_unix_nano: int
    monotonic: bool = False


def flatten_metrics(request: ExportMetricsServiceRequest) -> list[Point]:
    out: list[Point] = []
    for resource_metrics in request.resource_metrics:
        resource = attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = metric.WhichOneof("data")
                if kind not in ("gauge", "sum"):
                    raise ValueError(f"unexpected metric data {kind}")
                data = getattr(metric, kind)
                for p in data.data_points:
                    value = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                    out.append(
                        Point(
                            resource, metric.name, kind, metric.unit, attributes(p.attributes),
                            value, p.time_unix_nano, p.start_time_unix_nano,
                            kind == "sum" and data.is_monotonic,
                        )
                    )  # fmt: skip
    return out


@dataclass(frozen=True)
class Answer:
    """A planned answer: a status, and for 2xx the records to declare rejected."""

    status: int = 200
    rejected: int = 0
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Request:
    at: float
    headers: dict[str, str]
    wire_bytes: int
    size: int  # bytes of the decoded protobuf
    logs: list[Log]
    status: int = 0

    @property
    def record_ids(self) -> list[str]:
        return [str(log.attributes.get("gpuid.record.id", "")) for log in self.logs]


def _emitted_nanos(log: Log) -> int:
    """An allocation's LogRecord has no time (it has no read_time): its event's time, from
    the body (an end's ended_at, a start's started_at)."""
    try:
        record = log.record
        moment = datetime.fromisoformat(record.get("ended_at") or record["started_at"])
    except (ValueError, KeyError, TypeError):
        return 0
    return int(moment.timestamp() * 1e9)


def status_body(code: int, message: str) -> bytes:
    """A `google.rpc.Status` by hand (code = field 1, message = field 2), as a collector sends;
    the proto package has no Status type."""
    text = message.encode()
    return b"\x08" + bytes([code]) + b"\x12" + _varint(len(text)) + text


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class OtlpReceiver:
    def __init__(self, ssl_context: ssl.SSLContext | None = None, *, keep: bool = True) -> None:
        """`keep=False` (a benchmark's long run) keeps only the ids of accepted records."""
        self._ssl = ssl_context
        self._keep = keep
        self._accepted: set[str] = set()
        self._order: list[str] = []  # accepted ids in arrival order, for /ids?after=N
        # (record time, seconds from it to acceptance) of accepted records, for /p99
        self.lags: list[tuple[int, float]] = []
        self.requests: list[Request] = []
        self.malformed = 0
        self.metric_pushes: list[list[Point]] = []  # accepted pushes
        self.metric_requests: list[tuple[float, int]] = []  # (when, status) of every push
        self.metrics_plan: deque[Answer] = deque()
        self.plan: deque[Answer] = deque()
        self.decide: Callable[[Request], Answer | None] | None = None
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"{'https' if self._ssl else 'http'}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/logs"

    async def _handle(self, request: web.Request) -> web.Response:
        wire = await request.read()  # as sent: the runner does not undo Content-Encoding
        if request.content_type != PROTOBUF:
            self.malformed += 1
            return web.Response(status=415, text=f"unsupported content type {request.content_type}")
        try:
            raw = wire
            if request.headers.get("Content-Encoding", "").lower() == "gzip":
                raw = gzip.decompress(wire)
            if request.path == "/v1/metrics":
                metrics = ExportMetricsServiceRequest()
                metrics.ParseFromString(raw)
                return self._metrics_answer(flatten_metrics(metrics))
            message = ExportLogsServiceRequest()
            message.ParseFromString(raw)
            logs = flatten(message)
        except (OSError, EOFError, zlib.error, DecodeError, ValueError, UnicodeDecodeError) as exc:
            self.malformed += 1
            return web.Response(
                status=400, body=status_body(3, f"malformed request: {exc}"), content_type=PROTOBUF
            )
        entry = Request(time.monotonic(), dict(request.headers), len(wire), len(raw), logs)
        self.requests.append(entry)
        answer = (self.decide(entry) if self.decide else None) or (
            self.plan.popleft() if self.plan else Answer()
        )
        entry.status = answer.status
        if 200 <= answer.status < 300:
            now = time.time_ns()
            for log, record_id in zip(entry.logs, entry.record_ids, strict=True):
                if record_id not in self._accepted:
                    self._accepted.add(record_id)
                    self._order.append(record_id)
                at = log.time_unix_nano or _emitted_nanos(log)
                self.lags.append((at, (now - at) / 1e9))
        if not self._keep:
            entry.logs = []
        if answer.status >= 300:
            body = status_body(14 if answer.status == 503 else 3, answer.message or "no")
            return web.Response(
                status=answer.status, body=body, headers=answer.headers, content_type=PROTOBUF
            )
        response = ExportLogsServiceResponse()
        if answer.rejected or answer.message:
            response.partial_success.rejected_log_records = answer.rejected
            response.partial_success.error_message = answer.message
        return web.Response(
            status=answer.status,
            body=response.SerializeToString(),
            headers=answer.headers,
            content_type=PROTOBUF,
        )

    def _metrics_answer(self, points: list[Point]) -> web.Response:
        answer = self.metrics_plan.popleft() if self.metrics_plan else Answer()
        self.metric_requests.append((time.monotonic(), answer.status))
        if answer.status >= 300:
            body = status_body(14 if answer.status == 503 else 3, answer.message or "no")
            return web.Response(
                status=answer.status, body=body, headers=answer.headers, content_type=PROTOBUF
            )
        self.metric_pushes.append(points if self._keep else [])
        response = ExportMetricsServiceResponse()
        if answer.rejected or answer.message:
            response.partial_success.rejected_data_points = answer.rejected
            response.partial_success.error_message = answer.message
        return web.Response(body=response.SerializeToString(), content_type=PROTOBUF)

    async def _count(self, request: web.Request) -> web.Response:
        server = self._runner.server if self._runner is not None else None
        connections = len(server.connections) if server is not None else 0
        return web.json_response({"records": len(self._accepted), "connections": connections})

    async def _ids(self, request: web.Request) -> web.Response:
        """Accepted record ids from the `after`-th on (a poller fetches only what is new)."""
        after = int(request.query.get("after", "0"))
        return web.json_response(self._order[after:])

    async def _p99(self, request: web.Request) -> web.Response:
        """p99 of record time to acceptance, over records timed at or after `since` (ns)."""
        since = int(request.query.get("since", "0"))
        lags = sorted(lag for at, lag in self.lags if at >= since)
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None
        return web.json_response({"p99": p99, "records": len(lags)})

    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_post("/v1/logs", self._handle)
        app.router.add_post("/v1/metrics", self._handle)
        app.router.add_get("/count", self._count)
        app.router.add_get("/ids", self._ids)
        app.router.add_get("/p99", self._p99)
        # Decompressing here (not in aiohttp) lets tests see the size on the wire and a bad
        # gzip stream answered as a collector does, with 400.
        self._runner = web.AppRunner(app, access_log=None, auto_decompress=False)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self._ssl)
        await self._site.start()
        self.port = self._site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def accepted(self) -> list[Log]:
        return [log for r in self.requests if 200 <= r.status < 300 for log in r.logs]

    def accepted_ids(self) -> set[str]:
        return set(self._accepted)


def main(port: int) -> None:
    """The receiver in its own process (the benchmarks'); GET /count answers what it took.
    SIGUSR1 stops listening (an outage: the socket and every connection close, what was
    taken is kept), SIGUSR2 listens again on the same port."""

    async def run() -> None:
        receiver = OtlpReceiver(keep=False)
        await receiver.start(port)
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[Any]] = set()

        def later(action: Callable[[], Any]) -> None:
            task = loop.create_task(action())
            pending.add(task)
            task.add_done_callback(pending.discard)

        loop.add_signal_handler(signal.SIGUSR1, later, receiver.stop)
        loop.add_signal_handler(signal.SIGUSR2, later, lambda: receiver.start(port))
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main(int(sys.argv[1]))
