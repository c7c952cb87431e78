"""HTTP exporter against a real aiohttp receiver."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent import __version__
from gpuid_agent.delivery.exporters.base import EXCERPT_CHARS, excerpt
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker, Outcome
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import readings, wire_id
from tests.servers.receiver import Receiver, Reply
from tests.servers.tls import make_ca_and_server
from tests.waiting import eventually

Factory = Callable[..., HttpExporter]
FAST = BatchPolicy(
    batch_size=4, flush_interval=0.02, retry_count=2, backoff_base=0.01, backoff_max=0.05
)


@pytest.fixture
async def make(receiver: Receiver) -> AsyncIterator[Factory]:
    made: list[HttpExporter] = []

    def factory(**kw: Any) -> HttpExporter:
        endpoint = kw.pop("endpoint", receiver.url)
        exporter = HttpExporter(endpoint, timeout=kw.pop("timeout", 5.0), **kw)
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


async def test_posts_gpuid_shaped_json_with_headers(make: Factory, receiver: Receiver) -> None:
    batch = readings(1)
    await make(token="tok-123").export(batch)
    (got,) = receiver.requests
    assert got.headers["Content-Type"] == "application/json"
    assert got.headers["User-Agent"] == f"gpuid-agent/{__version__}"
    assert got.headers["Authorization"] == "Bearer tok-123"
    assert got.headers["X-Records-Count"] == "4"
    assert len(got.headers["Idempotency-Key"]) == 32
    assert [r["record_id"] for r in got.records] == [wire_id(r) for r in batch]
    first = got.records[0]
    # gpuid's body fields (its receivers read `time`), plus ours
    for field in ("cluster", "node", "machine", "source", "chassis", "gpu", "time", "uuid"):
        assert field in first
    assert first["time"] == first["read_time"] == batch[0].read_time


async def test_gzip_body(make: Factory, receiver: Receiver) -> None:
    await make(gzip_body=True).export(readings(5))
    (got,) = receiver.requests
    assert got.headers["Content-Encoding"] == "gzip"
    assert len(got.records) == 20
    assert int(got.headers["Content-Length"]) < got.size / 3  # compressed on the wire


async def test_token_file_is_reread_when_it_changes(
    make: Factory, receiver: Receiver, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    exporter = make(token_file=str(token))
    await exporter.export(readings(1))
    replacement = tmp_path / "token.new"
    replacement.write_text("second")
    os.replace(replacement, token)  # how a mounted Secret is swapped
    await exporter.export(readings(1))
    assert [r.headers["Authorization"] for r in receiver.requests] == [
        "Bearer first",
        "Bearer second",
    ]
    token.unlink()
    with pytest.raises(ExportError) as info:
        await exporter.export(readings(1))
    assert info.value.retryable
    assert info.value.error_type == "auth"
    assert not (await exporter.health()).ok


async def test_5xx_and_429_are_retried_with_one_idempotency_key(
    make: Factory, receiver: Receiver
) -> None:
    receiver.plan.extend([Reply(503), Reply(429, headers={"Retry-After": "0"}), Reply(200)])
    metrics = AgentMetrics()
    worker = ExporterWorker(make(), FAST, metrics)
    assert await worker.deliver(readings(1)) is Outcome.DELIVERED
    assert [r.status for r in receiver.requests] == [503, 429, 200]
    assert len({r.headers["Idempotency-Key"] for r in receiver.requests}) == 1
    assert (
        metrics.registry.get_sample_value("gpuid_export_retries_total", {"exporter": "http"}) == 2
    )
    assert (
        metrics.registry.get_sample_value(
            "gpuid_export_failure_total", {"exporter": "http", "error_type": "http_503"}
        )
        == 1
    )


async def test_retry_after_is_honoured(make: Factory, receiver: Receiver) -> None:
    receiver.plan.append(Reply(429, headers={"Retry-After": "1"}))
    worker = ExporterWorker(make(), FAST, AgentMetrics())  # its own backoff is ≤ 0.05 s
    assert await worker.deliver(readings(1)) is Outcome.DELIVERED
    first, second = receiver.requests
    assert second.at - first.at >= 0.95


@pytest.mark.parametrize(
    ("header", "expected"), [("7", 7.0), ("86400", 300.0), ("1.5", None), ("-5", None)]
)
async def test_retry_after_header_is_read_by_the_one_parser(
    make: Factory, receiver: Receiver, header: str, expected: float | None
) -> None:
    receiver.plan.append(Reply(429, headers={"Retry-After": header}))
    exporter = make()
    with pytest.raises(ExportError) as info:
        await exporter.export(readings(1))
    assert info.value.retryable
    assert info.value.retry_after == expected


async def test_400_is_set_aside_not_looped(
    make: Factory, receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.decide = lambda req: (
        Reply(400, body="record 3: field gpu is bogus") if len(req.records) == 4 else None
    )
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "http", 1 << 20)
    worker = ExporterWorker(make(token="tok-secret"), FAST, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    for record in readings(1) + readings(1, node="n2")[:2]:
        await worker.put(record)
    await eventually(lambda: receiver.accepted_ids())  # the later batch still goes through
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    assert [r.status for r in receiver.requests] == [400, 200]  # sent once, never again
    assert (
        metrics.registry.get_sample_value(
            "gpuid_export_set_aside_batches_total", {"exporter": "http"}
        )
        == 1
    )
    assert len(list((tmp_path / "http" / "rejected").glob("*.ndjson"))) == 1
    logged = [r for r in caplog.records if r.getMessage() == "batch set aside"]
    assert logged
    assert "HTTP 400: record 3: field gpu is bogus" in logged[0].reason
    assert "tok-secret" not in caplog.text


async def test_connection_refused_and_timeout_are_retryable(
    make: Factory, receiver: Receiver
) -> None:
    with pytest.raises(ExportError) as refused:
        await make(endpoint="http://127.0.0.1:1/ingest").export(readings(1))
    assert refused.value.retryable
    assert refused.value.error_type == "connection"
    receiver.plan.append(Reply(200, delay=0.6))
    with pytest.raises(ExportError) as slow:
        await make(timeout=0.2).export(readings(1))
    assert slow.value.retryable
    assert slow.value.error_type == "timeout"


async def test_custom_ca_bundle(tmp_path: Path) -> None:
    ca, server_context = make_ca_and_server(tmp_path)
    server = Receiver(ssl_context=server_context)
    await server.start()
    trusting = HttpExporter(server.url, ca_bundle=str(ca), timeout=5)
    default = HttpExporter(server.url, timeout=5)
    try:
        await trusting.export(readings(1))
        with pytest.raises(ExportError) as info:
            await default.export(readings(1))
        assert info.value.error_type in ("tls", "connection")
        assert info.value.retryable
    finally:
        await trusting.close()
        await default.close()
        await server.stop()
    assert len(server.requests) == 1


@given(st.text(max_size=1000), st.text(min_size=1, max_size=20))
def test_excerpt_is_short_single_line_and_redacted(body: str, secret: str) -> None:
    out = excerpt(body + secret + body, secret)
    assert len(out) <= EXCERPT_CHARS + 1
    assert "\n" not in out
    assert "\r" not in out
    if secret not in "<redacted>":
        assert secret not in excerpt(secret * 3, secret)


async def test_a_ca_bundle_removed_after_start_is_named_in_the_error(tmp_path: Path) -> None:
    ca, server_context = make_ca_and_server(tmp_path)
    server = Receiver(ssl_context=server_context)
    await server.start()
    exporter = HttpExporter(server.url, ca_bundle=str(ca), timeout=5)
    ca.unlink()  # passed the start-time check, then the mount went away
    try:
        with pytest.raises(ExportError) as info:
            await exporter.export(readings(1))
    finally:
        await exporter.close()
        await server.stop()
    assert info.value.error_type == "tls" and info.value.retryable
    assert "HTTP_CA_BUNDLE" in str(info.value) and str(ca) in str(info.value)
