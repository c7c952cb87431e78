"""Many nodes' exporters through a real PgBouncer in transaction pooling mode (two server
connections): every path of a delivery — direct COPY, the re-send probe, staging for
allocations and events, coalesced stored batches — works, and each record is stored once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import datetime, timedelta

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables, stored_payload
from gpuid_agent.records.types import AllocationRecord
from tests.exporter_support import allocation, health, readings
from tests.servers.pgbouncer import PgBouncer, ensure_installed
from tests.servers.postgres import PostgresCluster

NODES = 12


@pytest.fixture
def pgbouncer(postgres: PostgresCluster) -> Iterator[PgBouncer]:
    reason = ensure_installed()
    if reason:
        pytest.skip(f"PgBouncer test needs pgbouncer: {reason}")
    bouncer = PgBouncer(postgres, pool_size=2)
    bouncer.start()
    try:
        yield bouncer
    finally:
        bouncer.stop()


async def test_transaction_pooling_delivers_every_path_once(
    postgres: PostgresCluster, pgbouncer: PgBouncer, pg_schema: str
) -> None:
    tables = Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events")
    # Tables created once against the server itself, as the docs say.
    direct = PostgresExporter(**postgres.connect_kwargs(), sslmode="disable", tables=tables)  # type: ignore[arg-type]
    await direct.migrate(await direct._ready())
    await direct.close()

    fleet = [
        PostgresExporter(
            **pgbouncer.connect_kwargs(),  # type: ignore[arg-type]
            sslmode="disable",
            tables=tables,
            timeout=20.0,
            application_name=f"bouncer-node-{i}",
        )
        for i in range(NODES)
    ]

    async def node(i: int, exporter: PostgresExporter) -> None:
        name = f"b{i}"
        start = allocation(pod=f"p{i}", node=name, uuid=f"GPU-{name}-0")
        first = readings(2, node=name)
        await exporter.export([*first, start, health(node=name)])
        await exporter.export(first[:3])  # a re-send: refused COPY, probe, nothing twice
        spooled = [stored_payload(readings(1, node=f"{name}-late")) for _ in range(3)]
        await exporter.export_stored(spooled, BatchMeta.new())  # one coalesced delivery
        end = allocation(pod=f"p{i}", node=name, uuid=f"GPU-{name}-0", ended_at=start_time(start))
        await exporter.export([end])

    try:
        for _ in range(2):  # twice: the second round re-sends everything
            await asyncio.gather(*(node(i, e) for i, e in enumerate(fleet)))
    finally:
        await asyncio.gather(*(e.close() for e in fleet))

    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        r = f"{pg_schema}.gpu_readings"
        assert await db.fetchval(f"SELECT count(*) FROM {r}") == NODES * 12
        assert await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {r}") == NODES * 12
        ended = await db.fetchval(
            f"SELECT count(*) FROM {pg_schema}.gpu_allocations WHERE ended_at IS NOT NULL"
        )
        assert ended == NODES
        assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_events") == NODES
        servers = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND usename = $1 AND pid <> pg_backend_pid()",
            "gpuid",
        )
        assert servers <= 2  # what the pool holds, whatever the number of nodes
    finally:
        await db.close()


def start_time(record: AllocationRecord) -> datetime:
    started = datetime.fromisoformat(record.started_at.replace("Z", "+00:00"))
    return started + timedelta(minutes=5)
