"""A spooled PostgreSQL backlog drained by the pipeline, against a raw COPY of the same rows.

One run, one server, identical empty tables: a raw asyncpg `copy_records_to_table` of the
pre-built rows, then the same 100,000 records spooled by the agent's disk spool at
BATCH_SIZE 10 and at 10,000 and drained by the real worker and exporter (goal: each drain
≥ 0.8x the raw COPY). Filling the spool is not timed: on a node it happens record by record,
long before the backlog drains.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import Row
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.types import ReadingRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import readings
from tests.servers.postgres import PostgresCluster

BACKLOG = int(os.environ.get("GPUID_BENCH_BACKLOG", "100000"))
BATCH_SIZES = (10, 10_000)
GOAL = 0.8


def _tables(schema: str) -> Tables:
    return Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")


async def _fill(
    directory: Path, exporter: PostgresExporter, records: list[ReadingRecord], size: int
) -> DiskSpool:
    spool = DiskSpool(directory, 1 << 34, form=exporter.stored_form)
    for i in range(0, len(records), size):
        await spool.add(records[i : i + size])
    return spool


async def _drain(exporter: PostgresExporter, spool: DiskSpool, size: int, total: int) -> float:
    policy = BatchPolicy(batch_size=size, flush_interval=0.01, timeout=300.0)
    worker = ExporterWorker(exporter, policy, AgentMetrics(), store=spool)
    started = time.perf_counter()
    task = asyncio.create_task(worker.run())
    while worker.describe()["delivered_records"] < total:
        if task.done():
            raise RuntimeError(f"worker ended early: {worker.describe()['last_error']}")
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - started
    worker.close_intake()
    await asyncio.wait_for(task, 60)
    return elapsed


async def _raw_copy(cluster: PostgresCluster, rows: list[tuple[Any, ...]], schema: str) -> float:
    import asyncpg

    conn = await asyncpg.connect(**cluster.connect_kwargs())
    try:
        await asyncio.to_thread(cluster.psql, "CHECKPOINT")
        started = time.perf_counter()
        await conn.copy_records_to_table(
            "gpu_readings", schema_name=schema, records=rows, columns=rowmap.READING_COLUMNS
        )
        return time.perf_counter() - started
    finally:
        await conn.close()


async def run() -> list[Row]:
    reason = PostgresCluster.unavailable()
    if reason:
        return [Row("postgres drain", "backlog", 0, "-", f"skipped: {reason}")]
    records = readings(BACKLOG // 4, step=timedelta(milliseconds=1))
    rows = rowmap.split(records).readings
    gc.collect()
    gc.freeze()
    cluster = PostgresCluster()
    await asyncio.to_thread(cluster.start)
    kw: dict[str, Any] = {**cluster.connect_kwargs(), "sslmode": "disable", "timeout": 300.0}
    out: list[Row] = []
    try:
        for size in BATCH_SIZES:
            # Each drain is paired with a raw COPY just before it, on identical empty tables
            # (created by the exporter's migration), so load on a shared machine hits both.
            for schema in (f"raw{size}", f"drain{size}"):
                setup = PostgresExporter(**kw, tables=_tables(schema))
                await setup.migrate(await setup._ready())
                await setup.close()
            with tempfile.TemporaryDirectory() as directory:
                exporter = PostgresExporter(**kw, tables=_tables(f"drain{size}"))
                spool = await _fill(Path(directory), exporter, records, size)
                raw = await _raw_copy(cluster, rows, f"raw{size}")
                await exporter._ready()
                await asyncio.to_thread(cluster.psql, "CHECKPOINT")
                elapsed = await _drain(exporter, spool, size, len(records))
                await exporter.close()
            ratio = raw / elapsed
            out.append(
                Row(
                    "postgres drain",
                    f"raw COPY (paired with BATCH_SIZE {size:,})",
                    len(records) / raw,
                    "records/s",
                    f"{len(records):,} pre-built rows, one copy_records_to_table",
                )
            )
            out.append(
                Row(
                    "postgres drain",
                    f"backlog BATCH_SIZE {size:,}",
                    len(records) / elapsed,
                    "records/s",
                    f"{len(records) // size:,} spooled batches: {ratio:.2f}x raw COPY "
                    f"(goal ≥ {GOAL}x){'' if ratio >= GOAL else ' MISSED'}",
                )
            )
    finally:
        await asyncio.to_thread(cluster.close)
    return out
