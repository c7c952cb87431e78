"""PostgreSQL exporter against a real throwaway cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.exporters.postgres.rows import reading_row
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records import columns
from gpuid_agent.records.serialize import rfc3339, to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import (
    BASE_TIME,
    allocation,
    health,
    readings,
    spool_files,
    wire_id,
)
from tests.record_strategies import HASHABLE, INT, READINGS, RECORDS
from tests.servers.postgres import PostgresCluster
from tests.waiting import eventually

Factory = Callable[..., PostgresExporter]


def tables(schema: str) -> Tables:
    return Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")


@pytest.fixture
async def make(postgres: PostgresCluster, pg_schema: str) -> AsyncIterator[Factory]:
    made: list[PostgresExporter] = []

    def factory(**overrides: Any) -> PostgresExporter:
        kw: dict[str, Any] = {
            **postgres.connect_kwargs(),
            "sslmode": "disable",
            "tables": tables(pg_schema),
            "timeout": 10.0,
        }
        kw.update(overrides)
        exporter = PostgresExporter(**kw)
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


async def count(db: asyncpg.Connection, table: str, where: str = "TRUE") -> int:
    return int(await db.fetchval(f"SELECT count(*) FROM {table} WHERE {where}"))


async def test_migration_creates_gpuid_compatible_table(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    await make().export(readings(1))
    columns = {
        r["column_name"]: (r["data_type"], r["character_maximum_length"], r["is_nullable"])
        for r in await db.fetch(
            "SELECT column_name, data_type, character_maximum_length, is_nullable "
            "FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2",
            pg_schema,
            "gpu_readings",
        )
    }
    for name in ("cluster", "node", "machine", "source", "chassis", "gpu"):
        assert columns[name] == ("character varying", 255, "NO")
    assert columns["id"][0] == "bigint"
    assert columns["read_time"][0] == columns["created_at"][0] == "timestamp with time zone"
    assert {"record_id", "uuid", "gpu_index", "attributes", "mig_devices"} <= columns.keys()
    indexes = {
        r["indexname"]: r["indexdef"]
        for r in await db.fetch(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1", pg_schema
        )
    }
    for gpuid_index in ("cluster", "node", "read_time", "created_at"):
        assert f"idx_gpu_readings_{gpuid_index}" in indexes
    assert "UNIQUE" in indexes["idx_gpu_readings_record_id"]
    assert {"gpu_allocations_pkey", "idx_gpu_events_record_id"} <= indexes.keys()


async def test_same_batch_twice_stores_each_record_once(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporter = make()
    batch = readings(3)  # GB200: 4 dies, 2 serials — both dies of a serial are kept
    await exporter.export(batch)
    await exporter.export(batch)
    await exporter.export(batch[:5] + readings(1, read_time=BASE_TIME + timedelta(hours=1)))
    table = f"{pg_schema}.gpu_readings"
    assert await count(db, table) == 16
    assert await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {table}") == 16
    row = await db.fetchrow(f"SELECT * FROM {table} WHERE record_id = $1", wire_id(batch[0]))
    assert (row["cluster"], row["node"], row["machine"], row["gpu"], row["chassis"]) == (
        "c1",
        "n1",
        "m1",
        "SN-A",
        "CH-1",
    )
    assert row["read_time"] == BASE_TIME
    assert row["uuid"] == batch[0].uuid
    assert row["gpu_index"] == 0


async def test_many_agents_migrating_at_once(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporters = [make() for _ in range(8)]
    await asyncio.gather(*(e.export(readings(1, node=f"n{i}")) for i, e in enumerate(exporters)))
    assert await count(db, f"{pg_schema}.gpu_readings") == 32
    # Later starts find the schema current and take no lock at all.
    await make().export(readings(1, node="late"))
    assert await count(db, f"{pg_schema}.gpu_readings") == 36


async def test_migrates_a_table_gpuid_created(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    table = f"{pg_schema}.gpu_readings"
    await db.execute(f"CREATE SCHEMA {pg_schema}")
    await db.execute(
        f"""CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY,
            cluster VARCHAR(255) NOT NULL, node VARCHAR(255) NOT NULL,
            machine VARCHAR(255) NOT NULL, source VARCHAR(255) NOT NULL,
            chassis VARCHAR(255) NOT NULL, gpu VARCHAR(255) NOT NULL,
            read_time TIMESTAMP WITH TIME ZONE NOT NULL,
            created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW(),
            UNIQUE(cluster, node, machine, source, chassis, gpu, read_time))"""
    )
    await db.execute(
        f"INSERT INTO {table} (cluster, node, machine, source, chassis, gpu, read_time) "
        "VALUES ('old', 'n0', 'm0', 'gpuid', '', 'SN-OLD', now())"
    )
    batch = readings(1, serials=["SN-A", "SN-B", "SN-C", "SN-D"])
    exporter = make()
    await exporter.export(batch)
    await exporter.export(batch)
    assert await count(db, table) == 5
    assert await count(db, table, "record_id IS NULL") == 1  # gpuid's row is kept as it was
    # gpuid's all-column UNIQUE refuses the second die of a GB200 superchip (same serial):
    # the fast COPY is refused, the staging path skips the conflict, nothing fails.
    await exporter.export(readings(1, node="gb200"))
    assert await count(db, table, "node = 'gb200'") == 2


async def test_allocation_end_updates_its_row(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporter = make()
    start = allocation(pod="p1")
    end = allocation(pod="p1", ended_at=BASE_TIME + timedelta(hours=2))
    other = allocation(pod="p2", uuid="GPU-n1-1")
    await exporter.export([start, other])
    await exporter.export([end])
    table = f"{pg_schema}.gpu_allocations"
    assert await count(db, table) == 2
    row = await db.fetchrow(f"SELECT * FROM {table} WHERE pod = 'p1'")
    assert row["started_at"] == BASE_TIME
    assert row["ended_at"] == BASE_TIME + timedelta(hours=2)
    assert (row["start_record_id"], row["end_record_id"]) == (start.record_id, end.record_id)
    assert (row["namespace"], row["workload_kind"], row["workload_name"]) == (
        "ml",
        "Deployment",
        "trainer",
    )
    updated = row["updated_at"]
    # Re-sent records (a retry, a spool replay) change nothing, in any order.
    await exporter.export([end, start])
    again = await db.fetchrow(f"SELECT * FROM {table} WHERE pod = 'p1'")
    assert again["updated_at"] == updated
    assert again["ended_at"] == row["ended_at"]
    assert await count(db, table, "ended_at IS NULL") == 1


async def test_allocation_start_and_end_in_one_batch(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    end = allocation(pod="p3", ended_at=BASE_TIME + timedelta(minutes=5))
    await make().export([end, allocation(pod="p3")])
    row = await db.fetchrow(f"SELECT * FROM {pg_schema}.gpu_allocations")
    assert row["started_at"] == BASE_TIME
    assert row["ended_at"] == BASE_TIME + timedelta(minutes=5)


async def test_other_kinds_go_to_events(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    check = health()
    bad_reading = replace(readings(1)[0], read_time="not a time")
    exporter = make()
    await exporter.export([check, bad_reading])
    await exporter.export([check])
    rows = await db.fetch(
        f"SELECT kind, payload, observed_at FROM {pg_schema}.gpu_events ORDER BY kind"
    )
    assert [r["kind"] for r in rows] == ["health", "reading"]
    assert '"reason": "XID 79"' in rows[0]["payload"]
    assert rows[0]["observed_at"] == BASE_TIME
    assert '"not a time"' in rows[1]["payload"]  # nothing lost, even what a column cannot hold


# Readings with a read_time the readings table takes (random text rarely is one), hostile
# everywhere else, some with a value that must change to fit its column (an index past INTEGER,
# a model past VARCHAR(255)): the readings table's own path, not only the events table's.
OUTSIZED = st.sampled_from([2**31, -(2**31) - 1, 2**63 - 1, -(2**63)])
LONG_TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=256, max_size=300)
TIMED_READINGS = st.builds(
    lambda r, t, index, model: replace(r, read_time=rfc3339(t), index=index, model=model),
    READINGS,
    st.datetimes(timezones=st.just(UTC)),
    INT | OUTSIZED,
    st.none() | HASHABLE | LONG_TEXT,
)


def as_stored(value: Any) -> Any:
    """A value as PostgreSQL text and jsonb can hold it: strings without NUL characters, lone
    surrogates replaced; integers from 2**63 in size as their decimal text (the JSON writer's
    bound); nothing else changes."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return str(value)
    if isinstance(value, str):
        return value.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {as_stored(k): as_stored(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_stored(v) for v in value]
    return value


def json_column(value: Any) -> Any:
    return orjson.loads(value) if isinstance(value, str) else value


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(RECORDS | TIMED_READINGS)
async def test_hostile_records_are_stored_not_refused(
    make: Factory, db: asyncpg.Connection, pg_schema: str, record: AnyRecord
) -> None:
    """Each record is in its table afterwards, whole: every field as sent, in its column or
    (changed to fit one) in the row's JSON, less only what PostgreSQL cannot hold."""
    names = [f"{pg_schema}.{t}" for t in ("gpu_readings", "gpu_allocations", "gpu_events")]
    for name in names:  # this example's rows alone (ids and allocation ids may repeat)
        if await db.fetchval("SELECT to_regclass($1)", name) is not None:
            await db.execute(f"TRUNCATE {name}")
    exporter = make()
    try:
        await exporter.export([record])
    finally:
        await exporter.close()
    wire = to_wire(record)
    sent = as_stored(wire)
    if record.kind == "allocation" and record.event != "usage":
        table = "gpu_allocations"
    elif record.kind == "reading" and reading_row(wire) is not None:
        table = "gpu_readings"
    else:
        table = "gpu_events"
    counts = {n.rpartition(".")[2]: await count(db, n) for n in names}
    assert counts == {n: int(n == table) for n in counts}
    row = await db.fetchrow(f"SELECT * FROM {pg_schema}.{table}")
    if table == "gpu_readings":
        kept = json_column(row["attributes"]) or {}
        rebuilt = {c.source: row[c.name] for c in columns.READINGS if c.name != "attributes"}
        assert rebuilt.pop("read_time") == datetime.fromisoformat(wire["read_time"])
        assert rebuilt | kept == {k: v for k, v in sent.items() if k not in ("kind", "read_time")}
        return
    stored = json_column(row["attributes" if table == "gpu_allocations" else "payload"])
    assert stored == sent
    ids = (
        {row["start_record_id"], row["end_record_id"]}
        if table == "gpu_allocations"
        else {row["record_id"]}
    )
    assert sent["record_id"] in ids or not sent["record_id"]  # none given: one is derived


async def test_wrong_password_is_retryable_and_secret(
    make: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = make(password="not-the-password")
    with pytest.raises(ExportError) as info:
        await exporter.export(readings(1))
    assert info.value.error_type == "auth"
    assert info.value.retryable
    assert "not-the-password" not in str(info.value)


async def test_missing_table_without_auto_migrate(make: Factory) -> None:
    with pytest.raises(ExportError) as info:
        await make(auto_migrate=False).export(readings(1))
    assert info.value.error_type == "schema"
    assert info.value.retryable
    assert "POSTGRES_AUTO_MIGRATE" in str(info.value)


def test_table_names_are_validated() -> None:
    with pytest.raises(ValueError, match="identifier"):
        Tables.named("gpu; DROP TABLE x", "a", "e")
    with pytest.raises(ValueError, match="identifier"):
        Tables.named("ok", "a b", "e")
    named = Tables.named("s.r", "a", "x.e")
    assert (named.allocations, named.events) == ("s.a", "x.e")


async def test_reconnects_after_server_restart(
    make: Factory, db: asyncpg.Connection, postgres: PostgresCluster, pg_schema: str
) -> None:
    exporter = make()
    await exporter.export(readings(1))
    await db.close()
    await asyncio.to_thread(postgres.stop_server, "fast")
    try:
        with pytest.raises(ExportError) as info:
            await exporter.export(readings(1, node="down"))
        assert info.value.retryable
        assert info.value.error_type == "connection"
    finally:
        await asyncio.to_thread(postgres.start_server)
    metrics = AgentMetrics()
    worker = ExporterWorker(
        exporter, BatchPolicy(retry_count=5, backoff_base=0.05, backoff_max=0.2), metrics
    )
    assert (await worker.deliver(readings(1, node="back"))).value == "delivered"
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        assert await count(conn, f"{pg_schema}.gpu_readings") == 8
    finally:
        await conn.close()


async def test_crash_after_commit_replays_without_duplicates(
    make: Factory, db: asyncpg.Connection, pg_schema: str, tmp_path: Any
) -> None:
    """A batch stored by the sink whose spool file survived (crash before the unlink)."""
    spool = DiskSpool(tmp_path / "postgres", 1 << 20)
    batch = readings(2)
    await spool.add(batch)
    stored = spool.oldest()
    assert stored is not None
    exporter = make()
    await exporter.export(await spool.load(stored), stored.meta)  # delivered, then "crash"
    restarted = DiskSpool(tmp_path / "postgres", 1 << 20)
    assert restarted.batches == 1
    worker = ExporterWorker(
        make(), BatchPolicy(flush_interval=0.01), AgentMetrics(), store=restarted
    )
    task = asyncio.create_task(worker.run())
    await eventually(lambda: restarted.batches == 0)
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    table = f"{pg_schema}.gpu_readings"
    assert await count(db, table) == 8
    assert await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {table}") == 8
    assert not spool_files(tmp_path / "postgres")


async def test_export_meta_is_optional(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    exporter = make()
    await exporter.export(readings(1), BatchMeta.new())
    await exporter.export(readings(1, node="n2"))  # no meta: the batch alone
    await exporter.export([])  # an empty batch is accepted and writes nothing
    table = f"{pg_schema}.gpu_readings"
    assert await count(db, table) == 8
    assert await count(db, table, "node = 'n2'") == 4
    assert await count(db, f"{pg_schema}.gpu_events") == 0
