"""Exporter throughput against real servers the benchmark starts itself.

- PostgreSQL: a 100,000-record backlog through the exporter (direct batches, and drained from
  the disk spool by the pipeline) vs a raw asyncpg COPY of the same rows into an identical
  table, in the same run (goal: exporter ≥ 0.5x raw COPY).
- HTTP: records/s to a local aiohttp receiver running in its own process.
- S3: objects/s to moto's S3 server.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import Row
from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.s3 import S3Exporter
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.types import ReadingRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import readings
from tests.servers.postgres import PostgresCluster, free_port
from tests.servers.s3 import CREDENTIALS, MotoServer

BACKLOG = 100_000
PG_BATCH = 10_000


def backlog(n: int) -> list[ReadingRecord]:
    """n distinct readings (4 GPUs per snapshot, one snapshot per millisecond)."""
    return readings(n // 4, step=timedelta(milliseconds=1))


def tables(schema: str) -> Tables:
    return Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")


async def _drain(worker: ExporterWorker, until: int, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while worker.describe()["delivered_records"] < until:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{worker.name}: {worker.describe()['delivered_records']}/{until} delivered"
            )
        await asyncio.sleep(0.005)


async def bench_postgres(records: list[ReadingRecord]) -> list[Row]:
    reason = PostgresCluster.unavailable()
    if reason:
        return [Row("exporters", "postgres", 0, "-", f"skipped: {reason}")]
    import asyncpg

    cluster = PostgresCluster()
    await asyncio.to_thread(cluster.start)
    kw: dict[str, Any] = {**cluster.connect_kwargs(), "sslmode": "disable", "timeout": 120.0}
    out: list[Row] = []
    try:
        # Identical empty tables for every contender, created by the exporter's migration.
        for schema in ("raw", "direct", "spooled"):
            setup = PostgresExporter(**kw, tables=tables(schema))
            await setup.migrate(await setup._ready())
            await setup.close()

        rows = rowmap.split(records).readings
        conn = await asyncpg.connect(**cluster.connect_kwargs())
        try:
            started = time.perf_counter()
            await conn.copy_records_to_table(
                "gpu_readings", schema_name="raw", records=rows, columns=rowmap.READING_COLUMNS
            )
            raw = time.perf_counter() - started
        finally:
            await conn.close()
        raw_rate = len(records) / raw
        out.append(
            Row(
                "exporters",
                "postgres raw COPY",
                raw_rate,
                "records/s",
                f"{len(records):,} rows, one COPY",
            )
        )

        exporter = PostgresExporter(**kw, tables=tables("direct"))
        await exporter._ready()
        started = time.perf_counter()
        for i in range(0, len(records), PG_BATCH):
            await exporter.export(records[i : i + PG_BATCH], BatchMeta.new())
        direct = time.perf_counter() - started
        await exporter.close()
        out.append(
            Row(
                "exporters",
                "postgres exporter",
                len(records) / direct,
                "records/s",
                f"batches of {PG_BATCH:,}: {raw / direct:.2f}x raw COPY (goal ≥ 0.5x)",
            )
        )

        with tempfile.TemporaryDirectory() as spool_dir:
            spool = DiskSpool(Path(spool_dir), 1 << 31)
            for i in range(0, len(records), PG_BATCH):
                await spool.add(records[i : i + PG_BATCH])
            exporter = PostgresExporter(**kw, tables=tables("spooled"))
            await exporter._ready()
            policy = BatchPolicy(batch_size=PG_BATCH, flush_interval=0.01, timeout=120.0)
            worker = ExporterWorker(exporter, policy, AgentMetrics(), store=spool)
            started = time.perf_counter()
            task = asyncio.create_task(worker.run())
            await _drain(worker, len(records))
            spooled = time.perf_counter() - started
            worker.close_intake()
            await asyncio.wait_for(task, 30)
            await exporter.close()
        out.append(
            Row(
                "exporters",
                "postgres backlog from spool",
                len(records) / spooled,
                "records/s",
                f"pipeline draining {len(records) // PG_BATCH} spooled batches: "
                f"{raw / spooled:.2f}x raw COPY",
            )
        )
    finally:
        await asyncio.to_thread(cluster.close)
    return out


def _start_receiver(port: int) -> subprocess.Popen[bytes]:
    """The counting receiver in its own process, so it does not share this event loop."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.servers.receiver", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(400):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("receiver did not start")


async def bench_http(records: list[ReadingRecord], batch_size: int = 1000) -> list[Row]:
    port = free_port()
    proc = await asyncio.to_thread(_start_receiver, port)
    out: list[Row] = []
    try:
        for gzip_body in (False, True):
            exporter = HttpExporter(f"http://127.0.0.1:{port}/ingest", gzip_body=gzip_body)
            policy = BatchPolicy(
                batch_size=batch_size, flush_interval=0.01, queue_size=len(records)
            )
            worker = ExporterWorker(exporter, policy, AgentMetrics())
            task = asyncio.create_task(worker.run())
            started = time.perf_counter()
            for record in records:
                await worker.put(record)
            await _drain(worker, len(records))
            elapsed = time.perf_counter() - started
            worker.close_intake()
            await asyncio.wait_for(task, 30)
            await exporter.close()
            name = "http gzip" if gzip_body else "http"
            note = f"{len(records):,} records, batches of {batch_size}, receiver in its own process"
            out.append(Row("exporters", name, len(records) / elapsed, "records/s", note))
    finally:
        proc.terminate()
        proc.wait(10)
    return out


async def bench_s3(objects: int = 300) -> list[Row]:
    server = MotoServer()
    await asyncio.to_thread(server.start)
    out: list[Row] = []
    try:
        client: Any = server.client()
        client.create_bucket(Bucket="bench")
        client.close()
        import os

        for name, value in CREDENTIALS.items():
            os.environ.setdefault(name, value)
        batch = readings(3)  # 12 records a batch
        exporter = S3Exporter("bench", endpoint_url=server.url, region="us-east-1", path_style=True)
        await exporter.export(batch, BatchMeta.new())  # connect before timing
        started = time.perf_counter()
        for _ in range(objects):
            await exporter.export(batch, BatchMeta.new())
        elapsed = time.perf_counter() - started
        await exporter.close()
        note = f"{objects} PUTs of {len(batch)}-record CSV objects to moto, one at a time"
        out.append(Row("exporters", "s3", objects / elapsed, "objects/s", note))
    finally:
        await asyncio.to_thread(server.stop)
    return out


async def run() -> list[Row]:
    records = backlog(BACKLOG)
    # The bench holds the whole backlog in memory (an agent does not): keep the collector from
    # rescanning it on every allocation burst, which would be measured as exporter time.
    gc.collect()
    gc.freeze()
    rows = await bench_postgres(records)
    rows += await bench_http(records[:50_000])
    rows += await bench_s3()
    return rows
