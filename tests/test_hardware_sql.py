"""The SQL recipes of docs/health.md ("GPU replaced") run against real PostgreSQL on records
the agent makes: the swap shows, and a GPU that moved between machines is found."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.hardware import HardwareWatch
from tests.test_exporter_postgres import Factory, make

__all__ = ["make"]  # fixture
DOCS = Path(__file__).resolve().parent.parent / "docs" / "health.md"
T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


def recipes() -> list[str]:
    section = DOCS.read_text(encoding="utf-8").split("## GPU replaced", 1)[1]
    [block] = re.findall(r"```sql\n(.*?)```", section, re.S)
    return [q.strip() for q in block.split(";") if q.strip()]


def _inventory(machine: str, cluster: str, at: datetime, *slots: tuple[str, str]) -> NodeInventory:
    return NodeInventory(
        node=f"node-{machine}",
        cluster=cluster,
        machine=machine,
        machine_source="provider-id",
        driver_version=None,
        cuda_driver_version=None,
        gpus=tuple(
            GpuIdentity(index=i, uuid=f"GPU-{serial}", serial=serial, pci_bus_id=bus)
            for i, (bus, serial) in enumerate(slots)
        ),
        read_time=at,
    )


async def _never(records: list[dict[str, object]]) -> None:
    raise AssertionError("not used")


async def test_the_docs_recipes_find_swaps_and_moves(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    a = HardwareWatch(cluster="east", source="t", publish_durable=_never)
    b = HardwareWatch(cluster="west", source="t", publish_durable=_never)
    a.owed(_inventory("m-1", "east", T0, ("0000:18:00.0", "S1"), ("0000:2a:00.0", "S2")))
    b.owed(_inventory("m-2", "west", T0, ("0000:18:00.0", "S5")))
    # S2 is pulled from m-1 (S9 goes in) and put into m-2 a day later in place of S5
    swapped = a.owed(
        _inventory(
            "m-1", "east", T0 + timedelta(hours=1), ("0000:18:00.0", "S1"), ("0000:2a:00.0", "S9")
        )
    )
    moved = b.owed(_inventory("m-2", "west", T0 + timedelta(days=1), ("0000:18:00.0", "S2")))
    exporter = make()
    await exporter.export([*swapped, *moved])
    await exporter.export(swapped)  # a re-send is stored once
    swaps_sql, moves_sql, sightings_sql = (
        q.replace("gpu_events", f"{pg_schema}.gpu_events").replace(
            "gpu_readings", f"{pg_schema}.gpu_readings"
        )
        for q in recipes()
    )
    swaps = await db.fetch(swaps_sql)
    assert [(r["machine"], r["bus"], r["old_serial"], r["new_serial"]) for r in swaps] == [
        ("m-2", "0000:18:00.0", "S5", "S2"),
        ("m-1", "0000:2a:00.0", "S2", "S9"),
    ]
    [move] = await db.fetch(moves_sql)
    assert dataclasses.astuple(_Move(**dict(move))) == (
        "S2",
        "east",
        "m-1",
        T0 + timedelta(hours=1),
        "west",
        "m-2",
        T0 + timedelta(days=1),
    )
    assert await db.fetch(sightings_sql) == []  # runs; no readings were exported here


@dataclasses.dataclass
class _Move:
    serial: str
    from_cluster: str
    from_machine: str
    left_at: datetime
    to_cluster: str
    to_machine: str
    arrived_at: datetime
