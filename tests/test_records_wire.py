"""The wire form of every record kind is pinned: field names, values, order-free JSON and
record ids must stay what sinks and queries already hold (tests/data/records_wire.json was
produced by the record code before records became typed)."""

from __future__ import annotations

import sys
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from gpuid_agent.facts import GpuIdentity, MigDevice, NodeInventory, PlatformInfo
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.health import health_records
from gpuid_agent.records.readings import reading_records
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import (
    AllocationRecord,
    HardwareRecord,
    Header,
    HealthRecord,
    ReadingRecord,
)
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.health.verdicts import CheckStatus, Transition
from tests import golden_manifest

FIXTURE = Path(__file__).parent / "data" / "records_wire.json"
T0 = datetime(2025, 3, 1, 12, 0, 0, 123000, tzinfo=UTC)


def _inventory(read_time: datetime = T0, machine_source: str = "dmi") -> NodeInventory:
    platform = PlatformInfo(
        "CH-1", slot_number=1, tray_index=2, host_id=1, peer_type=0, module_id=1
    )
    mig = MigDevice(0, "MIG-1", gpu_instance_id=3, compute_instance_id=0, profile="1g.10gb")
    gpus = (
        GpuIdentity(
            index=0,
            uuid="GPU-0",
            serial="SN-A",
            name="NVIDIA GB200",
            pci_bus_id="0000:01:00.0",
            module_id=1,
            board_part_number="BPN-1",
            platform=platform,
            mig_devices=(mig,),
        ),
        GpuIdentity(index=1, uuid="GPU-1", serial=None, name="NVIDIA H100", platform=None),
    )
    return NodeInventory("n1", "c1", "m1", machine_source, "570.1", "12.8", gpus, read_time)


def _readings() -> list[ReadingRecord]:
    inv = _inventory()
    removed = GpuIdentity(index=7, uuid="GPU-7", serial="SN-Z", name="NVIDIA GB200")
    return reading_records(inv, source="test/agent", reason="startup") + reading_records(
        inv, source="test/agent", reason="change", changed={"GPU-0": "mig"}, removed=[removed]
    )


def _allocations() -> list[AllocationRecord]:
    clock = iter([T0, T0, T0 + timedelta(seconds=5), T0 + timedelta(seconds=9)])
    trail = AllocationTrail(
        TrailIdentity("c1", "n1", "test/agent"),
        publish_durable=_unused,
        clock=lambda: next(clock),
    )
    inv = _inventory()
    whole = Allocation(
        Holder("ml", "train", "main", "uid-1", "Job", "train"), "nvidia.com/gpu", "GPU-0", "GPU-0"
    )
    mig = Allocation(Holder("ml", "mig", "c"), "nvidia.com/mig-1g.10gb", "MIG-1", "GPU-0", "MIG-1")
    shared = Allocation(
        Holder("inf", "serve", "srv"), "nvidia.com/gpu", "GPU-1::2", "GPU-1", None, 2
    )
    out = trail.owed(Attribution("current", (whole, mig, shared)), inv)
    out += trail.owed(Attribution("current", (whole, mig, shared)), inv)
    out += trail.owed(Attribution("current", (whole,)), inv)
    return out


async def _unused(records: list[AllocationRecord]) -> None:
    raise AssertionError("the wire test publishes nothing")


def _health() -> list[HealthRecord]:
    inv = _inventory()
    prev = CheckStatus("healthy", None, "none", T0)
    cur = CheckStatus(
        "degraded", "persistence mode off", "check_workload", T0 + timedelta(seconds=1)
    )
    return health_records(
        [
            Transition("persistence", cur, prev, "GPU-0", 0, "degraded"),
            Transition("gpu_count", cur, None),
        ],
        inv,
        source="test/agent",
    )


def current_wire() -> dict[str, list[dict[str, Any]]]:
    return {
        "reading": [to_wire(r) for r in _readings()],
        "allocation": [to_wire(r) for r in _allocations()],
        "health": [to_wire(r) for r in _health()],
    }


def test_wire_records_match_the_pinned_fixture() -> None:
    pinned = orjson.loads(FIXTURE.read_bytes())
    now = orjson.loads(orjson.dumps(current_wire()))
    for kind in ("reading", "allocation", "health"):
        assert len(now[kind]) == len(pinned[kind]), kind
        for got, want in zip(now[kind], pinned[kind], strict=True):
            assert got == want, (kind, want["record_id"])


def test_every_record_kind_declares_the_one_header() -> None:
    header = set(Header.__annotations__) | {"kind"}
    for kind in (ReadingRecord, AllocationRecord, HealthRecord, HardwareRecord):
        declared = [f.name for f in fields(kind)]
        assert header <= set(declared), kind
        assert declared[:2] == ["schema_version", "kind"], kind


if __name__ == "__main__":  # regenerate only when the wire format is meant to change
    FIXTURE.write_bytes(
        orjson.dumps(current_wire(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n"
    )
    golden_manifest.after_regenerating(sys.argv[1:])
