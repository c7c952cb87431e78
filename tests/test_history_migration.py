"""The migration step history needs, on a real PostgreSQL: a database an older agent made
gains the indexes and the usage rollup at the next agent's first delivery, the rollup is
rebuilt from the usage records already stored, and from then on each record is added exactly
once, whatever is re-sent; a usage record it cannot read adds nothing and fails nothing."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables, usage_rollup
from gpuid_agent.delivery.exporters.postgres.schema import history_indexes
from gpuid_agent.records.types import AllocationRecord, AnyRecord
from tests.history_support import allocations, readings
from tests.servers.postgres import PostgresCluster

Factory = Callable[..., PostgresExporter]


@pytest.fixture
async def make(postgres: PostgresCluster, pg_schema: str) -> AsyncIterator[Factory]:
    made: list[PostgresExporter] = []

    def factory() -> PostgresExporter:
        kwargs: Any = postgres.connect_kwargs()
        exporter = PostgresExporter(
            **kwargs,
            sslmode="disable",
            tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
            timeout=10.0,
        )
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


def usage_records() -> list[AllocationRecord]:
    return [r for r in allocations() if isinstance(r, AllocationRecord) and r.event == "usage"]


async def rollup(db: asyncpg.Connection, schema: str) -> tuple[float, int]:
    row = await db.fetchrow(
        f"SELECT COALESCE(sum(gpu_seconds), 0), COALESCE(sum(records), 0) "
        f"FROM {schema}.gpu_events_usage"
    )
    return float(row[0]), int(row[1])


async def test_an_older_database_is_upgraded_and_its_usage_summed_once(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    records = usage_records()
    first, later = records[:20], records[20:]
    await make().export(first)
    tables = Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events")
    # what an older agent left: its tables and records, no history indexes, no rollup
    for index in history_indexes(tables):
        await db.execute(f"DROP INDEX {pg_schema}.{index}")
    await db.execute(f"DROP TABLE {pg_schema}.gpu_events_usage")
    await db.execute(f"DROP TRIGGER {usage_rollup.trigger_name(tables.events)} ON {tables.events}")

    later_agent = make()
    await later_agent.export(later + first[:5])  # five of them re-sent
    found = {
        r[0]
        for r in await db.fetch("SELECT indexname FROM pg_indexes WHERE schemaname = $1", pg_schema)
    }
    assert set(history_indexes(tables)) <= found
    unique = {r.record_id: r for r in records}
    expected = sum(r.gpu_seconds or 0 for r in unique.values())
    assert await rollup(db, pg_schema) == (expected, len(unique))
    # and again, all of it: nothing is added twice
    await later_agent.export(list(records))
    assert await rollup(db, pg_schema) == (expected, len(unique))


async def test_a_usage_record_the_rollup_cannot_read_adds_nothing(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    from dataclasses import replace

    good = usage_records()[0]
    odd: list[AnyRecord] = [
        replace(good, record_id="bad-time", usage_start="2025-02-30T00:00:00.000Z"),
        replace(good, record_id="no-time", usage_start="yesterday"),
        replace(good, record_id="huge", gpu_seconds=1e308, energy_joules=None),
    ]
    exporter = make()
    await exporter.export([*readings()[:4], *odd, good])
    stored = await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_events")
    assert stored == 4  # every record stored, whatever the rollup made of it
    # the readable ones count as records; an amount past 1e300 (sums would overflow) adds 0
    seconds, counted = await rollup(db, pg_schema)
    assert (seconds, counted) == (good.gpu_seconds, 2)


DOC = Path(__file__).resolve().parents[1] / "docs" / "exporters" / "postgres.md"


def doc_statements() -> list[str]:
    block = re.search(r"<!-- history-indexes -->\s*```sql\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_docs_indexes_are_the_migrations() -> None:
    tables = Tables.named("gpu_readings", "gpu_allocations", "gpu_events")
    expected = [
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON {table} {how};"
        for name, (table, how) in history_indexes(tables).items()
    ]
    assert doc_statements() == expected


async def test_indexes_built_ahead_are_taken_as_they_are(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    """The docs' statements, run by hand (outside a transaction) on an older database: the
    next agent's migration finds the indexes and builds none of its own."""
    await make().export(usage_records()[:3])
    tables = Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events")
    for index in history_indexes(tables):
        await db.execute(f"DROP INDEX {pg_schema}.{index}")
    await db.execute(f"SET search_path TO {pg_schema}")
    for statement in doc_statements():
        await db.execute(statement)
    before = {
        r[0]: r[1]
        for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1", pg_schema
        )
    }
    await db.execute(f"DROP TABLE {pg_schema}.gpu_events_usage")  # so the migration runs
    await make().export(usage_records()[3:6])
    after = {
        r[0]: r[1]
        for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1", pg_schema
        )
    }
    assert {k: v for k, v in after.items() if k in before} == before
    assert await rollup(db, pg_schema) == (3600.0 * 6, 6)
