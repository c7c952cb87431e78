"""PostgreSQL tables that are not what the exporter writes (made by an older version or by
hand): a broken table fails its own kind of record alone, auto-migration completes every
column it can, and the hint says what to do under the settings in force. A real cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.exporters.postgres.schema import (
    ALLOCATION_TABLE,
    EVENT_TABLE,
    expected_columns,
)
from gpuid_agent.records.columns import READINGS
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError
from tests.exporter_support import allocation, health, readings
from tests.servers.postgres import PostgresCluster

Factory = Callable[..., PostgresExporter]


@pytest.fixture
async def make(postgres: PostgresCluster, pg_schema: str) -> AsyncIterator[Factory]:
    made: list[PostgresExporter] = []

    def factory(**overrides: Any) -> PostgresExporter:
        exporter = PostgresExporter(
            **postgres.connect_kwargs(),  # type: ignore[arg-type]
            sslmode="disable",
            tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
            timeout=10.0,
            **overrides,
        )
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


async def count(db: asyncpg.Connection, table: str) -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM {table}"))


async def columns_of(db: asyncpg.Connection, table: str) -> set[str]:
    rows = await db.fetch(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass($1) "
        "AND attnum > 0 AND NOT attisdropped",
        table,
    )
    return {r[0] for r in rows}


def mixed() -> list[AnyRecord]:
    return [*readings(2), allocation(pod="p1"), health()]


async def test_a_table_missing_columns_fails_its_kind_alone(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    r, a, e = (f"{pg_schema}.gpu_{t}" for t in ("readings", "allocations", "events"))
    await make().export(readings(1))  # the tables as this version makes them
    await db.execute(f"ALTER TABLE {a} DROP COLUMN pod, DROP COLUMN workload_name")

    plain = make(auto_migrate=False)
    batch = mixed()
    for _ in range(2):  # a retry writes the other kinds again, each row once
        with pytest.raises(ExportError) as info:
            await plain.export(batch)
        assert info.value.error_type == "schema" and info.value.retryable
        assert a in str(info.value) and "pod" in str(info.value)
        assert "set POSTGRES_AUTO_MIGRATE=true" in str(info.value)
        assert r not in str(info.value) and e not in str(info.value)
        assert (await count(db, r), await count(db, a), await count(db, e)) == (8, 0, 1)

    await make(auto_migrate=True).export(batch)  # completes the table, then delivers
    assert {"pod", "workload_name"} <= await columns_of(db, a)
    assert (await count(db, r), await count(db, a), await count(db, e)) == (8, 1, 1)
    assert await db.fetchval(f"SELECT pod FROM {a}") == "p1"


async def test_auto_migrate_adds_every_column_a_table_lacks_from_the_definitions(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporter = make()
    await exporter.export(readings(1))
    t = exporter.tables

    # every column that can be added to a table holding rows: nullable, or with a default
    def addable(declared: str) -> bool:
        return "PRIMARY" not in declared and ("NOT NULL" not in declared or "DEFAULT" in declared)

    droppable = {
        t.readings: [c.name for c in READINGS if not c.gpuid and c.name != "record_id"],
        t.allocations: [n for n, d in ALLOCATION_TABLE if addable(d)],
        t.events: [n for n, d in EVENT_TABLE if addable(d)],
    }
    for table, names in droppable.items():
        await db.execute(f"ALTER TABLE {table} " + ", ".join(f"DROP COLUMN {n}" for n in names))
    await make().export(mixed())  # a fresh agent finds the tables incomplete
    for table, wanted in expected_columns(t).items():
        assert wanted <= await columns_of(db, table), table
    assert await count(db, t.allocations) == 1


async def test_the_hint_is_true_to_auto_migrate(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporter = make()
    await exporter.export(readings(1))
    # NOT NULL without a default: no migration can add it to a table that holds rows
    await db.execute(f"ALTER TABLE {exporter.tables.allocations} DROP COLUMN cluster")
    await db.execute(
        f"INSERT INTO {exporter.tables.allocations} (allocation_id, node) VALUES ('x', 'n')"
    )
    with pytest.raises(ExportError) as info:
        await make(auto_migrate=True).export(mixed())
    message = str(info.value)
    assert "cluster" in message and "by hand" in message
    assert "set POSTGRES_AUTO_MIGRATE" not in message
    assert await count(db, exporter.tables.readings) == 8  # readings kept flowing
