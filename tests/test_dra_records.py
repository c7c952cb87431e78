"""Allocation records of DRA claims: start and end carry the claim, device-plugin records keep
their wire form, and the claim lands in the PostgreSQL allocations table (a table made
before the claim columns existed is migrated)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import asyncpg

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.serialize import allocation_from_wire, from_wire, to_wire
from gpuid_agent.state.attribution import Allocation, Attribution, Claim, Holder
from tests.servers.postgres import PostgresCluster
from tests.test_records_wire import T0, _inventory

CLAIM_KEYS = {"claim_namespace", "claim_name", "claim_source"}


async def _unused(records: list[dict[str, Any]]) -> None:
    raise AssertionError("nothing is published here")


def dra_records() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(records of a shared claim's two holders starting and one ending, a device-plugin
    allocation's start record)."""
    clock = iter([T0, T0, T0 + timedelta(seconds=5), T0 + timedelta(seconds=5)])
    trail = AllocationTrail(
        TrailIdentity("c1", "n1", "test/agent"), publish_durable=_unused, clock=lambda: next(clock)
    )
    shared = Claim("ml", "shared-gpu", "dra")
    a = Allocation(Holder("ml", "serve-a", "srv"), "gpu.nvidia.com", "n1/gpu-1", "GPU-1", None)
    b = Allocation(Holder("ml", "serve-b", "srv"), "gpu.nvidia.com", "n1/gpu-1", "GPU-1", None)
    mig = Allocation(
        Holder("ml", "small", "w"),
        "gpu.nvidia.com",
        "n1/gpu-0-mig-19-0-1",
        "GPU-0",
        "MIG-1",
        claim=Claim("ml", "mig-claim", "dra"),
    )
    plugin = Allocation(Holder("ml", "train", "main"), "nvidia.com/gpu", "GPU-0", "GPU-0")
    a, b = (Allocation(**{**_fields(x), "claim": shared}) for x in (a, b))
    inv = _inventory()
    out = trail.owed(Attribution("current", (a, b, mig, plugin)), inv)
    out += trail.owed(Attribution("current", (b, mig, plugin)), inv)
    wire = [to_wire(r) for r in out]
    dra = [r for r in wire if r["resource_name"] == "gpu.nvidia.com"]
    return dra, [r for r in wire if r["resource_name"] != "gpu.nvidia.com"]


def _fields(a: Allocation) -> dict[str, Any]:
    return {name: getattr(a, name) for name in Allocation.__slots__}


def test_claim_fields_in_start_and_end_records() -> None:
    dra, plugin = dra_records()
    events = [(r["pod"], r["event"], r["claim_name"], r["claim_source"]) for r in dra]
    assert events == [
        ("serve-a", "start", "shared-gpu", "dra"),
        ("serve-b", "start", "shared-gpu", "dra"),
        ("small", "start", "mig-claim", "dra"),
        ("serve-a", "end", "shared-gpu", "dra"),
    ]
    small = next(r for r in dra if r["pod"] == "small")
    assert (small["uuid"], small["mig_uuid"], small["mig_profile"]) == ("GPU-0", "MIG-1", "1g.10gb")
    for record in dra:
        assert record["claim_namespace"] == "ml"
        assert allocation_from_wire(record).claim_name == record["claim_name"]  # the trail state
    # a device-plugin record's wire is as before: no claim keys at all
    (start,) = plugin
    assert not CLAIM_KEYS & start.keys()
    assert allocation_from_wire(start).claim_name is None


async def test_claims_land_in_postgres_and_old_tables_migrate(
    postgres: PostgresCluster, pg_schema: str, db: asyncpg.Connection
) -> None:
    table = f"{pg_schema}.gpu_allocations"
    await db.execute(f"CREATE SCHEMA {pg_schema}")
    # the allocations table as the agent made it before DRA
    await db.execute(
        f"""CREATE TABLE {table} (
            allocation_id VARCHAR(255) PRIMARY KEY, cluster VARCHAR(255) NOT NULL,
            node VARCHAR(255) NOT NULL, machine VARCHAR(255) NOT NULL DEFAULT '',
            gpu VARCHAR(255) NOT NULL DEFAULT '', uuid VARCHAR(255), mig_uuid VARCHAR(255),
            namespace VARCHAR(255), pod VARCHAR(255), pod_uid VARCHAR(255),
            container VARCHAR(255), resource_name VARCHAR(255), device_id VARCHAR(255),
            workload_kind VARCHAR(255), workload_name VARCHAR(255),
            started_at TIMESTAMP WITH TIME ZONE, ended_at TIMESTAMP WITH TIME ZONE,
            start_record_id VARCHAR(255), end_record_id VARCHAR(255), attributes JSONB,
            created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW(),
            updated_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW())"""
    )
    exporter = PostgresExporter(
        **postgres.connect_kwargs(),  # type: ignore[arg-type]
        sslmode="disable",
        tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
        timeout=10.0,
    )
    dra, plugin = dra_records()
    try:
        await exporter.export([from_wire(r) for r in dra + plugin])
    finally:
        await exporter.close()
    rows = {
        r["pod"]: r
        for r in await db.fetch(
            f"SELECT pod, claim_namespace, claim_name, claim_source, ended_at FROM {table}"
        )
    }
    assert set(rows) == {"serve-a", "serve-b", "small", "train"}
    assert (rows["serve-a"]["claim_name"], rows["serve-a"]["ended_at"] is not None) == (
        "shared-gpu",
        True,
    )
    assert (rows["serve-b"]["claim_namespace"], rows["serve-b"]["claim_source"]) == ("ml", "dra")
    assert rows["small"]["claim_name"] == "mig-claim"
    assert rows["train"]["claim_name"] is None
