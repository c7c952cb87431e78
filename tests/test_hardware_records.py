"""`kind=hardware` records: a GPU swapped under the node is told exactly once, across restarts."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.hardware import HardwareWatch, hardware_record
from gpuid_agent.records.runner import run_emitter
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.gpu_slots import GpuSlots, changes
from gpuid_agent.state.state_file import StateDir
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakenvml.fixtures import FakeNvml
from tests.test_records_bus import snapshot
from tests.waiting import eventually

buses = st.text(alphabet="0123456789abcdef:.", min_size=1, max_size=16)
serials = st.text(min_size=1, max_size=12)


@given(st.dictionaries(buses, serials, max_size=8), st.dictionaries(buses, serials, max_size=8))
def test_changes_name_each_serial_at_most_once_and_nothing_for_no_change(
    before: dict[str, str], after: dict[str, str]
) -> None:
    found, remembered = changes(before, after)
    assert changes(before, before) == ([], before)
    olds = [old for _, _, old, _ in found if old is not None]
    news = [new for _, _, _, new in found if new is not None]
    assert set(olds) <= set(before.values()) and set(news) <= set(after.values())
    assert not set(olds) & set(after.values())  # a serial still on the node did not leave
    assert not set(news) & set(before.values())  # nor did one that was there arrive
    for event, bus, old, new in found:
        assert new is not None and after[bus] == new and (event == "added") == (old is None)
    assert after.items() <= remembered.items()  # what is there now is what is remembered
    # told once: the remembered slots against the same GPUs again say nothing
    assert changes(remembered, after)[0] == []


def test_a_swap_between_slots_is_no_replacement_and_a_new_serial_in_a_slot_is() -> None:
    two = {"a": "S1", "b": "S2"}
    assert changes(two, {"a": "S2", "b": "S1"})[0] == []
    assert changes(two, {"a": "S1", "b": "S9"})[0] == [("replaced", "b", "S2", "S9")]
    # S2 left slot b, S9 arrived in slot c: one replacement at the new slot
    assert changes(two, {"a": "S1", "c": "S9"})[0] == [("replaced", "c", "S2", "S9")]
    assert changes({}, {"a": "S1"})[0] == [("added", "a", None, "S1")]


def test_a_gpu_that_vanished_is_remembered_not_reported() -> None:
    found, remembered = changes({"a": "S1", "b": "S2"}, {"a": "S1"})  # off the bus
    assert found == [] and remembered == {"a": "S1", "b": "S2"}
    assert changes(remembered, {"a": "S1", "b": "S2"})[0] == []  # back after a reset
    assert changes(remembered, {"a": "S1", "b": "S7"})[0] == [("replaced", "b", "S2", "S7")]


def _inventory(*gpus: tuple[str, str | None]) -> NodeInventory:
    return NodeInventory(
        node="node-a",
        cluster="c",
        machine="m-1",
        machine_source="dmi",
        driver_version=None,
        cuda_driver_version=None,
        gpus=tuple(
            GpuIdentity(index=i, uuid=f"GPU-{i}-{serial}", serial=serial, pci_bus_id=bus)
            for i, (bus, serial) in enumerate(gpus)
        ),
        read_time=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_a_serial_that_did_not_read_is_no_removal() -> None:
    slots = GpuSlots()
    assert slots.update(_inventory(("0000:18:00.0", "S1"), ("0000:2A:00.0", "S2"))) == []
    assert slots.update(_inventory(("0000:18:00.0", "S1"), ("0000:2A:00.0", None))) == []
    swapped = _inventory(("0000:18:00.0", "S1"), ("0000:2a:00.0", "S3"))
    [change] = slots.update(swapped)
    assert change == ("replaced", "0000:2a:00.0", "S2", "S3")
    record = to_wire(hardware_record(swapped, change, cluster="c", source="t"))
    assert (record["event"], record["old_serial"], record["new_serial"]) == ("replaced", "S2", "S3")
    assert record["pci_bus_id"] == "0000:2a:00.0" and record["uuid"] == "GPU-1-S3"


async def _never(records: list[AnyRecord]) -> None:
    await asyncio.Event().wait()


async def test_a_kill_between_saving_and_publishing_republishes_the_same_record(
    tmp_path: Path,
) -> None:
    bus, state = SnapshotBus(), tmp_path / "hardware.json"
    first = HardwareWatch(
        cluster="c", source="t", publish_durable=_never, state_dir=StateDir(str(tmp_path))
    )
    task = asyncio.create_task(run_emitter(bus.subscribe("hardware"), first))
    bus.publish(snapshot(1, _inventory(("0000:18:00.0", "S1"))))
    await eventually(lambda: state.exists())  # the baseline
    bus.publish(snapshot(2, _inventory(("0000:18:00.0", "S2"))))
    await eventually(lambda: b'"pending":[{' in state.read_bytes())
    task.cancel()  # killed while the exporters still held nothing
    [owed] = orjson.loads(state.read_bytes())["pending"]
    assert (owed["old_serial"], owed["new_serial"]) == ("S1", "S2")
    published: list[AnyRecord] = []

    async def publish(records: list[AnyRecord]) -> None:
        published.extend(records)

    bus = SnapshotBus()
    second = HardwareWatch(
        cluster="c", source="t", publish_durable=publish, state_dir=StateDir(str(tmp_path))
    )
    runner = asyncio.create_task(run_emitter(bus.subscribe("hardware"), second))
    await eventually(lambda: published)
    bus.publish(snapshot(3, _inventory(("0000:18:00.0", "S2"))))  # the same slot: nothing new
    bus.close()
    await runner
    assert [to_wire(r) for r in published] == [owed]
    third = GpuSlots(StateDir(str(tmp_path)))
    assert third.pending == [] and third.serials == {"0000:18:00.0": "S2"}


def test_an_unreadable_state_file_is_survived_as_no_baseline(tmp_path: Path) -> None:
    (tmp_path / "hardware.json").write_bytes(b'{"version": 1, "slots": {"a": 7}}')
    slots = GpuSlots(StateDir(str(tmp_path)))
    assert slots.serials is None
    assert slots.update(_inventory(("a", "S1"))) == []  # a baseline, not a change


async def _run_once(fake: FakeNvml, config: fakenvml.FakeNvmlConfig, state: Path) -> list[Any]:
    fake.apply(config)
    out = io.BytesIO()
    s = settings(state_dir=str(state), nvml_library_path=str(fake.lib_path))
    agent = Agent(s, nvml_api=PynvmlApi(str(fake.lib_path)), exporters=[StdoutExporter(out)])
    async with running_agent(agent):
        await eventually(lambda: agent.hardware.status()["gpus"])  # the baseline
        await eventually(
            lambda: agent.hardware.status()["pending"] == 0 and (state / "hardware.json").exists()
        )
        await eventually(lambda: agent.bus.latest is not None)
    rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
    return [r for r in rows if r["kind"] == "hardware"]


async def test_a_replaced_gpu_is_one_record_across_restarts(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    config = fakenvml.h100x8()
    config.gpus = config.gpus[:3]
    assert await _run_once(fake_nvml, config, tmp_path) == []  # the baseline
    old = config.gpus[1].serial
    config.gpus[1] = dataclasses.replace(
        config.gpus[1], serial="1652423099999", uuid="GPU-00000000-0000-4000-8000-00000000beef"
    )
    [record] = await _run_once(fake_nvml, config, tmp_path)
    assert (record["event"], record["old_serial"], record["new_serial"]) == (
        "replaced",
        old,
        "1652423099999",
    )
    assert record["pci_bus_id"] == config.gpus[1].pci_bus_id and record["index"] == 1
    assert record["machine"] and record["gpu"] == "1652423099999"
    assert record["uuid"] == "GPU-00000000-0000-4000-8000-00000000beef"
    assert await _run_once(fake_nvml, config, tmp_path) == []  # told once


async def test_a_simulated_replacement_is_one_record(tmp_path: Path) -> None:
    out = io.BytesIO()
    s = settings(simulate="h100x8", fault="gpu-replaced:gpu3@0.5s", state_dir=str(tmp_path))
    agent = Agent(s, exporters=[StdoutExporter(out)])
    async with running_agent(agent):
        await eventually(lambda: b'"kind":"hardware"' in out.getvalue())
        await eventually(lambda: agent.hardware.status()["pending"] == 0)
    rows = [orjson.loads(line) for line in out.getvalue().splitlines()]
    [record] = [r for r in rows if r["kind"] == "hardware"]
    assert (record["event"], record["index"]) == ("replaced", 3)
    assert record["new_serial"].endswith("9999") and record["old_serial"] != record["new_serial"]
    assert record["uuid"].endswith("beef") and record["machine"] == "sim-node-a"
