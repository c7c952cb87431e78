"""A readings table gpuid created keeps its UNIQUE over gpuid's columns, which both dies of a
GB200 superchip share: the rows it refuses are counted and logged once with the fix, and the
fix the docs give works, on the real server."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import asyncpg
import pytest
from prometheus_client import generate_latest

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import BASE_TIME, readings
from tests.servers.postgres import PostgresCluster

DOC = Path(__file__).resolve().parents[1] / "docs" / "exporters" / "postgres.md"
FIX = re.compile(r"<!-- gpuid-constraint-fix -->\s*```sql\n(.*?)```", re.S)

# gpuid's own CREATE TABLE, as its migration runs it.
GPUID_DDL = """CREATE TABLE gpu_readings (id BIGSERIAL PRIMARY KEY,
    cluster VARCHAR(255) NOT NULL, node VARCHAR(255) NOT NULL,
    machine VARCHAR(255) NOT NULL, source VARCHAR(255) NOT NULL,
    chassis VARCHAR(255) NOT NULL, gpu VARCHAR(255) NOT NULL,
    read_time TIMESTAMP WITH TIME ZONE NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW(),
    UNIQUE(cluster, node, machine, source, chassis, gpu, read_time))"""


def discarded(metrics: AgentMetrics) -> float:
    return metrics.discarded_records.labels("postgres", "constraint")._value.get()


async def test_rows_gpuid_unique_drops_are_counted_logged_once_and_fixable(
    postgres: PostgresCluster, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    exporter = PostgresExporter(
        **postgres.connect_kwargs(),  # type: ignore[arg-type]
        sslmode="disable",
        tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
        timeout=10.0,
    )
    metrics = AgentMetrics()
    worker = ExporterWorker(exporter, BatchPolicy(), metrics)
    try:
        await db.execute(f"CREATE SCHEMA {pg_schema}")
        await db.execute(f"SET search_path TO {pg_schema}")  # the docs' unqualified name
        await db.execute(GPUID_DDL)
        constraint = await db.fetchval(
            "SELECT conname FROM pg_constraint WHERE conrelid = 'gpu_readings'::regclass "
            "AND contype = 'u'"
        )
        assert len(constraint) <= 63
        # the counter is there at 0 before anything happened (alerts can use it)
        exposition = generate_latest(metrics.registry).decode()
        assert (
            'gpuid_export_discarded_records_total{exporter="postgres",reason="constraint"} 0.0'
            in exposition
        )

        # A GB200 node: four dies, two serials (readings() default), same read_time.
        caplog.set_level(logging.INFO)
        outcome = await worker.deliver(readings(1))
        assert outcome.value == "delivered", worker.describe()["last_error"]
        assert await db.fetchval("SELECT count(*) FROM gpu_readings") == 2
        assert discarded(metrics) == 2
        second = readings(1, read_time=BASE_TIME.replace(minute=5))
        assert (await worker.deliver(second)).value == "delivered"
        assert discarded(metrics) == 4
        logged = [r for r in caplog.records if "unique constraint" in r.getMessage()]
        assert len(logged) == 1  # once, the counter has the rest
        message = logged[0].getMessage()
        assert f"ALTER TABLE {pg_schema}.gpu_readings DROP CONSTRAINT {constraint};" in message
        assert logged[0].levelno == logging.ERROR

        # The docs' statement, run as written, lets both dies in.
        [fix] = FIX.findall(DOC.read_text())
        assert constraint in fix
        await db.execute(fix)
        third = readings(1, read_time=BASE_TIME.replace(minute=10))  # after the fix
        assert (await worker.deliver(third)).value == "delivered"
        at = BASE_TIME.replace(minute=10)
        assert await db.fetchval("SELECT count(*) FROM gpu_readings WHERE read_time = $1", at) == 4
        assert discarded(metrics) == 4
        # both dies of one serial are there, told apart by uuid
        dies = await db.fetch(
            "SELECT uuid FROM gpu_readings WHERE gpu = 'SN-A' AND read_time = $1 ORDER BY uuid",
            at,
        )
        assert [r[0] for r in dies] == ["GPU-n1-0", "GPU-n1-1"]
    finally:
        await exporter.close()
        await db.close()
