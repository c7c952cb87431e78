from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.readings import ReadingEmitter
from gpuid_agent.records.readings import reading_records as typed_readings
from gpuid_agent.records.serialize import Wire, from_wire, to_wire
from gpuid_agent.records.types import ReadingRecord
from gpuid_agent.simulate.profiles import gb200x4, h100x8
from gpuid_agent.state.inventory import build_inventory, diff
from tests.test_records_bus import snapshot

T0 = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)


def _inventory(profile: str = "gb200x4", **changes: object) -> NodeInventory:
    sims = {"gb200x4": gb200x4, "h100x8": h100x8}[profile]("node-a")
    gpus = [
        GpuIdentity(
            index=i,
            uuid=g.uuid,
            serial=g.serial,
            name=g.name,
            pci_bus_id=g.pci_bus_id,
            minor_number=g.minor_number,
            module_id=g.module_id,
            platform=g.platform,
        )
        for i, g in enumerate(sims)
    ]
    base = {
        "node": "node-a",
        "cluster": "c1",
        "machine": "i-0abc",
        "machine_source": "provider_id",
        "driver_version": "570.86.15",
        "cuda_driver_version": "12.8",
        "read_time": T0,
    }
    base.update(changes)
    return build_inventory(gpus, **base)  # type: ignore[arg-type]


def test_diff_detects_added_removed_changed_and_node_changes() -> None:
    old = _inventory()
    assert diff(old, dataclasses.replace(old, read_time=datetime.now(UTC))) == []
    gpus = list(old.gpus)
    removed = gpus.pop(3)
    gpus[0] = dataclasses.replace(gpus[0], serial="9999999999999")
    added = dataclasses.replace(removed, uuid="GPU-new", index=3)
    new = dataclasses.replace(old, gpus=(*gpus, added), machine="i-0def")
    kinds = {(c.kind, c.uuid) for c in diff(old, new)}
    assert kinds == {
        ("node", None),
        ("changed", gpus[0].uuid),
        ("removed", removed.uuid),
        ("added", "GPU-new"),
    }
    changed = next(c for c in diff(old, new) if c.kind == "changed")
    assert changed.fields == ("serial",)
    node = next(c for c in diff(old, new) if c.kind == "node")
    assert node.fields == ("machine",)


def test_chassis_change_is_a_change() -> None:
    old = _inventory()
    moved = tuple(
        dataclasses.replace(g, platform=dataclasses.replace(g.platform, chassis_serial="C2"))  # type: ignore[type-var]
        for g in old.gpus
    )
    changes = diff(old, dataclasses.replace(old, gpus=moved))
    assert [c.kind for c in changes] == ["changed"] * 4
    assert all(c.fields == ("platform",) for c in changes)


def reading_records(*args: Any, **kw: Any) -> list[Wire]:
    """The readings as sinks receive them."""
    return [to_wire(r) for r in typed_readings(*args, **kw)]


def test_gb200_records_one_per_gpu_with_shared_serial() -> None:
    records = reading_records(_inventory(), source="ns/pod", reason="startup")
    assert len(records) == 4
    assert len({r["gpu"] for r in records}) == 2
    assert {r["chassis"] for r in records} == {gb200x4("node-a")[0].platform.chassis_serial}  # type: ignore[union-attr]
    first = records[0]
    for key in (
        "cluster",
        "node",
        "machine",
        "source",
        "chassis",
        "gpu",
        "read_time",
        "uuid",
        "index",
        "model",
        "pci_bus_id",
        "module_id",
        "driver_version",
        "schema_version",
        "record_id",
        "kind",
    ):
        assert key in first, key
    assert first["read_time"] == "2026-01-02T03:04:05.678Z"
    assert [r["module_id"] for r in records] == [1, 2, 3, 4]


def test_record_ids_are_deterministic_and_content_addressed() -> None:
    a = reading_records(_inventory(), source="s", reason="startup")
    b = reading_records(_inventory(), source="s", reason="startup")
    assert [r["record_id"] for r in a] == [r["record_id"] for r in b]
    assert len({r["record_id"] for r in a}) == 4
    later = reading_records(
        _inventory(read_time=T0.replace(second=6)), source="s", reason="heartbeat"
    )
    assert not {r["record_id"] for r in a} & {r["record_id"] for r in later}
    assert all(to_wire(from_wire(r))["record_id"] == r["record_id"] for r in a)


def test_h100_has_no_chassis() -> None:
    records = reading_records(_inventory("h100x8"), source="s", reason="startup")
    assert len(records) == 8 and len({r["gpu"] for r in records}) == 8
    assert {r["chassis"] for r in records} == {""}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_emitter_emits_on_start_change_and_heartbeat_only() -> None:
    """Through the protocol `run_emitter` drives (test_records_bus runs it on a bus): each
    snapshot noted and flushed in turn, so none is coalesced away."""
    published: list[list[Wire]] = []
    clock = _Clock()

    async def publish(records: list[ReadingRecord]) -> None:
        published.append([to_wire(r) for r in records])

    emitter = ReadingEmitter(source="s", heartbeat_interval=3600, publish=publish, clock=clock)
    inv = _inventory()
    seq = iter(range(1, 100))

    async def collect(inventory: NodeInventory) -> None:
        emitter.note(snapshot(next(seq), inventory))
        await emitter.flush()

    assert emitter.next_tick() is None  # no heartbeat before the first emission
    await collect(inv)
    assert [r["reason"] for r in published[-1]] == ["startup"] * 4
    for tick in range(5):  # unchanged collections: nothing
        await collect(dataclasses.replace(inv, read_time=T0.replace(second=tick)))
    assert len(published) == 1

    gpus = list(inv.gpus)
    gone = gpus.pop()
    await collect(dataclasses.replace(inv, gpus=tuple(gpus)))
    assert len(published) == 2
    changes = {r["uuid"]: r["change"] for r in published[-1]}
    assert changes[gone.uuid] == "removed" and len(changes) == 4

    assert emitter.next_tick() == 3600
    clock.now += 3600
    assert emitter.next_tick() == 0
    await emitter.tick()  # no snapshot came within the heartbeat interval
    assert [r["reason"] for r in published[-1]] == ["heartbeat"] * 3
    assert len(published) == 3
