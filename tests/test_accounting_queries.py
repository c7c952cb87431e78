"""The usage records of a day of allocations (a time-sliced GPU shared by two workloads, a
whole GPU, pods coming and going mid-period), made by the real accountant and allocation
trail, answer docs/accounting.md's recipes on the real PostgreSQL and, through moto's S3, on
DuckDB; a re-sent batch changes neither answer."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

import asyncpg
import duckdb
import pytest

from gpuid_agent.delivery.exporters.postgres import PostgresExporter
from gpuid_agent.delivery.exporters.s3 import S3Exporter
from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.state.accounting import Accountant, AccountingConfig
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.attribution.shares import PROCESSES_OFF
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.snapshot import NodeSnapshot
from tests.servers.postgres import PostgresCluster
from tests.servers.s3 import MotoServer
from tests.test_exporter_postgres import tables
from tests.test_s3_queries import DOC_ROOT, deliver, doc_sql, download

DOC = Path(__file__).resolve().parents[1] / "docs" / "accounting.md"
BLOCK = re.compile(r"<!-- (postgres|duckdb): usage-by-workload -->\n```sql\n(.*?)```", re.S)
RECONCILE = re.compile(r"<!-- postgres: usage-reconciliation -->\n```sql\n(.*?)```", re.S)
DAY = datetime(2025, 3, 1, tzinfo=UTC)
G0, G1 = "GPU-0", "GPU-1"
TRAIN = Holder("ml", "train-0", "main", "u1", "Job", "train")
SERVE = Holder("inf", "serve-0", "srv", "u2", "Deployment", "serve")
WATTS = {G0: 400.0, G1: 200.0}


def recipes() -> dict[str, str]:
    return dict(BLOCK.findall(DOC.read_text()))


def attribution(*held: tuple[Holder, str, str]) -> Attribution:
    allocations = tuple(Allocation(h, "nvidia.com/gpu", d, g) for h, d, g in held)
    by_device: dict[str, tuple[Holder, ...]] = {}
    for a in allocations:
        by_device[a.gpu_uuid] = (*by_device.get(a.gpu_uuid, ()), a.holder)
    return Attribution("current", allocations, by_device=MappingProxyType(by_device))


def usage_records(idle: bool = False) -> list[AnyRecord]:
    """Every 10 minutes from 09:00 to 12:00 UTC: GPU 0 time-sliced by train and serve until
    10:30, then train's alone; GPU 1 serve's from 09:00 to 11:20. At 400 W and 200 W. With
    `idle`, the GPUs' idle usage records too."""
    gpus = tuple(GpuIdentity(i, u, serial=f"SN-{i}") for i, u in enumerate((G0, G1)))
    accountant = Accountant(AccountingConfig(), "gpu-1")
    now = [DAY]
    trail = AllocationTrail(
        TrailIdentity("prod", "gpu-1", "gpuid-agent/test"),
        publish_durable=_unused,
        clock=lambda: now[0],
    )
    out: list[AnyRecord] = []
    for step in range(19):
        when = DAY + timedelta(hours=9, minutes=10 * step)
        held = [(TRAIN, f"{G0}::0", G0)]
        if when < DAY + timedelta(hours=10, minutes=30):
            held.append((SERVE, f"{G0}::1", G0))
        if when < DAY + timedelta(hours=11, minutes=20):
            held.append((SERVE, G1, G1))
        seconds = (when - DAY).total_seconds()
        samples = {
            u: GpuSample(u, MappingProxyType({"energy_mj": WATTS[u] * seconds * 1000}))
            for u in (G0, G1)
        }
        inv = NodeInventory("gpu-1", "prod", "m1", "dmi", None, None, gpus, when)
        attr = attribution(*held)
        view = accountant.advance(inv, samples, attr, PROCESSES_OFF)
        snapshot = NodeSnapshot(step, "collection", inv, samples, NodeHealth(), attr)
        now[0] = when
        trail.note(replace(snapshot, accounting=view))
        latest, trail._latest = trail._latest, None
        assert latest is not None
        out += trail.owed(*latest)
        out += trail.usage.due(list(trail.allocations.open.values()), when)
        out += trail.idle_owed(when) if idle else []
    return out


async def _unused(records: list[AnyRecord]) -> None:
    raise AssertionError("not published here")


def hours(h: float) -> float:
    return round(h, 3)


# (namespace, kind, name, GPU-hours, kWh) of 09:00-12:00 (the 12:00 step closes 11:00-12:00)
EXPECTED = [
    # train: half of GPU 0 09:00-10:30 (0.75 h), then all of it 10:30-12:00 (1.5 h)
    ("ml", "Job", "train", hours(0.75 + 1.5), hours((0.75 + 1.5) * 0.4)),
    # serve: half of GPU 0 09:00-10:30 and GPU 1 09:00-11:20
    ("inf", "Deployment", "serve", hours(0.75 + 7 / 3), hours(0.75 * 0.4 + 7 / 3 * 0.2)),
]


def check(rows: list[tuple[Any, ...]]) -> None:
    got = {r[1]: (r[1], r[2], r[3], float(r[4]), float(r[5])) for r in rows}
    assert got["ml"] == pytest.approx(EXPECTED[0], abs=0.002)
    assert got["inf"] == pytest.approx(EXPECTED[1], abs=0.002)
    assert {r[0].date() if isinstance(r[0], datetime) else r[0] for r in rows} == {DAY.date()}


async def test_postgres_recipe_sums_usage(postgres: PostgresCluster, pg_schema: str) -> None:
    records = usage_records()
    exporter = PostgresExporter(
        **postgres.connect_kwargs(), sslmode="disable", tables=tables(pg_schema), timeout=10.0
    )
    try:
        await exporter.export(records)
        await exporter.export(records)  # a re-send: the same rows
    finally:
        await exporter.close()
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        sql = recipes()["postgres"].replace("FROM gpu_events", f"FROM {pg_schema}.gpu_events")
        rows = [tuple(r) for r in await conn.fetch(sql)]
        ended = await conn.fetch(
            f"SELECT pod, gpu_seconds, energy_joules FROM {pg_schema}.gpu_allocations "
            "WHERE ended_at IS NOT NULL ORDER BY pod"
        )
    finally:
        await conn.close()
    check([(r[0], *r[1:4], Decimal(r[4]), Decimal(r[5])) for r in rows])
    # serve's two allocations ended: their totals are in the allocations table
    assert sorted(round(r["gpu_seconds"]) for r in ended) == [2700, 8400]
    print("PostgreSQL:", rows)


def test_duckdb_recipe_sums_usage(moto_server: MotoServer, s3_bucket: str, tmp_path: Path) -> None:
    records = usage_records()

    async def write() -> None:
        exporter = S3Exporter(
            s3_bucket, endpoint_url=moto_server.url, region="us-east-1", path_style=True,
            timeout=5.0,
        )  # fmt: skip
        try:
            await deliver(exporter, records + records, tmp_path / "spool")  # sent twice
        finally:
            await exporter.close()

    asyncio.run(write())
    download(moto_server, s3_bucket, tmp_path / "bucket")
    db = duckdb.connect()
    db.execute("SET TimeZone = 'America/Los_Angeles'")  # answers must not depend on it
    allocations = doc_sql()[("duckdb", "tables")].split(";")[1]  # exporters/s3.md's view
    db.execute(allocations.replace(DOC_ROOT, str(tmp_path / "bucket" / "gpuid")))
    rows = db.execute(recipes()["duckdb"]).fetchall()
    check(rows)
    print("DuckDB:", rows)


async def test_postgres_reconciliation_adds_up_to_the_gpus_time_and_energy(
    postgres: PostgresCluster, pg_schema: str
) -> None:
    """Held and idle usage records of the day: 2 GPUs x 3 h, 600 W x 3 h."""
    records = usage_records(idle=True)
    exporter = PostgresExporter(
        **postgres.connect_kwargs(), sslmode="disable", tables=tables(pg_schema), timeout=10.0
    )
    try:
        await exporter.export(records)
    finally:
        await exporter.close()
    [sql] = RECONCILE.findall(DOC.read_text())
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        [row] = await conn.fetch(sql.replace("FROM gpu_events", f"FROM {pg_schema}.gpu_events"))
    finally:
        await conn.close()
    assert (row["node"], row["gpus"]) == ("gpu-1", 2)
    held = 3 + 7 / 3  # GPU 0 held all 3 h (shared, then train's alone); GPU 1 serve's 7/3 h
    assert float(row["held_gpu_hours"]) == pytest.approx(held, abs=0.002)
    assert float(row["idle_gpu_hours"]) == pytest.approx(6 - held, abs=0.002)
    assert float(row["gpu_hours"]) == pytest.approx(2 * 3, abs=0.002)
    assert float(row["kwh"]) == pytest.approx(0.6 * 3, abs=0.002)
