from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.delivery.pipeline import (
    BatchPolicy,
    ExporterWorker,
    Outcome,
    Pipeline,
)
from gpuid_agent.records.types import AnyRecord, ReadingRecord
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.retry import backoff_delay
from tests.exporter_support import numbered
from tests.waiting import eventually


def _records(n: int) -> list[ReadingRecord]:
    return numbered(n, padding=200)


def _lines(stream: io.BytesIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


class _Rejecting(Exporter):
    """A sink that refuses every batch's content (like an HTTP 400)."""

    name = "rejecting"

    def __init__(self) -> None:
        self.calls = 0

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        self.calls += 1
        raise ExportError("400 bad request", error_type="http_400", retryable=False)


async def test_batches_by_size_then_by_flush_interval() -> None:
    stream = io.BytesIO()
    metrics = AgentMetrics()
    worker = ExporterWorker(
        StdoutExporter(stream), BatchPolicy(batch_size=4, flush_interval=0.2), metrics
    )
    task = asyncio.create_task(worker.run())
    pipeline = Pipeline([worker], metrics)
    await pipeline.publish(_records(10))
    # two full batches go at once; the two records left wait for the flush interval
    await eventually(lambda: len(_lines(stream)) == 8)
    await eventually(
        lambda: (
            metrics.registry.get_sample_value("gpuid_export_success_total", {"exporter": "stdout"})
            == 3
        )
    )
    assert [r["uuid"] for r in _lines(stream)] == [f"r{i}" for i in range(10)]
    worker.close_intake()
    await asyncio.wait_for(task, 2)


async def test_close_flushes_a_partial_batch_without_waiting() -> None:
    stream = io.BytesIO()
    worker = ExporterWorker(
        StdoutExporter(stream), BatchPolicy(batch_size=100, flush_interval=3600), AgentMetrics()
    )
    task = asyncio.create_task(worker.run())
    for r in _records(7):
        await worker.put(r)
    await asyncio.sleep(0.05)  # a hold: nothing may be written before the close
    assert _lines(stream) == []
    worker.close_intake()
    await asyncio.wait_for(task, 2)
    assert len(_lines(stream)) == 7


async def test_slow_sink_applies_backpressure_and_memory_stays_bounded() -> None:
    read_fd, write_fd = os.pipe()
    reader = os.fdopen(read_fd, "rb", buffering=0)
    writer = os.fdopen(write_fd, "wb", buffering=0)
    policy = BatchPolicy(batch_size=10, flush_interval=0.01, queue_size=50)
    worker = ExporterWorker(StdoutExporter(writer), policy, AgentMetrics())
    task = asyncio.create_task(worker.run())
    pipeline = Pipeline([worker], AgentMetrics())
    producer = asyncio.create_task(pipeline.publish(_records(2000)))
    # A hold: nobody reads the pipe, its buffer fills and writes block; the producer must
    # still be waiting after it.
    await asyncio.sleep(0.5)
    assert not producer.done()
    assert worker.pending <= policy.queue_size
    received = b""
    loop = asyncio.get_running_loop()
    while received.count(b"\n") < 2000:
        received += await loop.run_in_executor(None, reader.read, 1 << 16)
    await asyncio.wait_for(producer, 5)
    assert [orjson.loads(x)["uuid"] for x in received.splitlines()] == [
        f"r{i}" for i in range(2000)
    ]
    worker.close_intake()
    await asyncio.wait_for(task, 5)
    reader.close()
    writer.close()


async def test_broken_sink_is_retried_with_backoff_and_reported() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # every write now fails with EPIPE
    writer = os.fdopen(write_fd, "wb", buffering=0)
    metrics = AgentMetrics()
    policy = BatchPolicy(retry_count=2, backoff_base=0.001, backoff_max=0.002)
    worker = ExporterWorker(StdoutExporter(writer), policy, metrics)
    outcome = await worker.deliver(_records(3))
    assert outcome is Outcome.FAILED
    failures = metrics.registry.get_sample_value(
        "gpuid_export_failure_total", {"exporter": "stdout", "error_type": "io"}
    )
    assert failures == 3  # 1 + RETRY_COUNT attempts
    health = worker.health()
    assert not health.ok and "Broken pipe" in (health.reason or "")
    writer.close()


async def test_rejected_batch_is_set_aside_not_looped() -> None:
    metrics = AgentMetrics()
    sink = _Rejecting()
    worker = ExporterWorker(
        sink, BatchPolicy(batch_size=5, flush_interval=0.01, retry_count=5), metrics
    )
    task = asyncio.create_task(worker.run())
    for r in _records(5):
        await worker.put(r)
    await eventually(
        lambda: (
            metrics.registry.get_sample_value(
                "gpuid_dropped_records_total", {"exporter": "rejecting", "reason": "rejected"}
            )
            == 5
        )
    )
    worker.close_intake()
    await asyncio.wait_for(task, 2)
    assert sink.calls == 1  # the worker ended without sending the set-aside batch again


@pytest.mark.parametrize("attempt", range(12))
def test_backoff_is_capped_and_jittered(attempt: int) -> None:
    delays = [backoff_delay(attempt, 0.5, 30.0) for _ in range(200)]
    assert all(0 <= d <= min(30.0, 0.5 * 2**attempt) for d in delays)
    assert len(set(delays)) > 1
