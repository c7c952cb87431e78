"""The emitters as consumers of the SnapshotBus: what they publish, and draining on close."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from gpuid_agent.facts import NodeInventory
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.health import HealthPublisher
from gpuid_agent.records.readings import ReadingEmitter
from gpuid_agent.records.runner import run_emitter
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.health.verdicts import CheckStatus, NodeHealth, Transition
from gpuid_agent.state.snapshot import NodeSnapshot
from tests.exporter_support import BASE_TIME, inventory
from tests.waiting import eventually

Records = list[dict[str, Any]]


def snapshot(
    seq: int,
    inv: NodeInventory,
    attribution: Attribution | None = None,
    *,
    pods_ready: bool = True,
    transitions: tuple[Transition, ...] = (),
) -> NodeSnapshot:
    return NodeSnapshot(
        seq,
        "collection",
        inv,
        {},
        NodeHealth(),
        attribution or Attribution("unavailable"),
        transitions,
        pods_ready,
    )


def collector(out: Records) -> Any:
    async def publish(records: list[AnyRecord]) -> None:
        out.extend(to_wire(r) for r in records)

    return publish


def alloc(pod: str, device: str) -> Allocation:
    return Allocation(Holder("ml", pod, "main"), "nvidia.com/gpu", device, device)


async def test_reading_emitter_follows_the_bus_and_drains_on_close() -> None:
    bus, out = SnapshotBus(), []
    emitter = ReadingEmitter(source="s", heartbeat_interval=3600, publish=collector(out))
    task = asyncio.create_task(run_emitter(bus.subscribe("readings"), emitter))
    bus.publish(snapshot(1, inventory()))
    await eventually(lambda: len(out) == 4)
    bus.publish(snapshot(2, inventory(read_time=BASE_TIME + timedelta(seconds=1))))
    changed = inventory(serials=["SN-A", "SN-A", "SN-B", "SN-C"])
    bus.publish(snapshot(3, changed))
    bus.close()
    await asyncio.wait_for(task, 5)
    reasons = [r["reason"] for r in out]
    assert reasons[:4] == ["startup"] * 4
    # whatever was coalesced, the last snapshot's change is published before run() returns
    assert [r["gpu"] for r in out[-4:]] == ["SN-A", "SN-A", "SN-B", "SN-C"]
    assert out[-1]["reason"] == "change"


async def test_trail_takes_only_current_attributions_with_pods_ready() -> None:
    """With "a" open, each snapshot that would end it reaches the trail (published once the
    one before is taken: none coalesced away, checked below) and ends nothing: an attribution
    before the pods' metadata is in, one pending, one unavailable."""
    bus, out = SnapshotBus(), []
    trail = AllocationTrail(TrailIdentity("c1", "n1", "s"), publish_durable=collector(out))
    sub = bus.subscribe("allocations")
    task = asyncio.create_task(run_emitter(sub, trail))
    inv = inventory()
    bus.publish(snapshot(1, inv, Attribution("current", (alloc("a", "GPU-n1-0"),))))
    await eventually(lambda: out)
    for seq, attribution, ready in (
        (2, Attribution("current", ()), False),
        (3, Attribution("pending"), True),
        (4, Attribution("unavailable"), True),
    ):
        bus.publish(snapshot(seq, inv, attribution, pods_ready=ready))
        await asyncio.sleep(0)  # the runner, woken by the publish, takes it before we go on
    held = (alloc("a", "GPU-n1-0"), alloc("b", "GPU-n1-1"))
    bus.publish(snapshot(5, inv, Attribution("current", held)))
    bus.close()
    await asyncio.wait_for(task, 5)
    assert sub.coalesced == 0
    assert [(r["event"], r["pod"]) for r in out] == [("start", "a"), ("start", "b")]
    assert trail.status()["open"] == 2


async def test_health_publisher_turns_every_snapshots_transitions_into_records() -> None:
    bus, out = SnapshotBus(), []
    publisher = HealthPublisher(collector(out), source="s")
    sub = bus.subscribe("health-records", events=True)
    task = asyncio.create_task(run_emitter(sub, publisher))
    inv = inventory()
    status = CheckStatus("degraded", "hot", "check_workload", BASE_TIME)
    for seq in range(1, 4):  # none may be coalesced away
        t = Transition("thermal", status, None, f"GPU-n1-{seq}", seq)
        bus.publish(snapshot(seq, inv, transitions=(t,)))
    bus.publish(snapshot(4, inv))  # no transitions: no record
    bus.close()
    await asyncio.wait_for(task, 5)
    assert [r["uuid"] for r in out] == ["GPU-n1-1", "GPU-n1-2", "GPU-n1-3"]
    assert {r["kind"] for r in out} == {"health"} and out[0]["source"] == "s"


async def test_trail_owes_records_again_when_the_durable_hand_off_fails() -> None:
    out: Records = []
    failing = True

    async def publish_durable(records: list[AnyRecord]) -> None:
        if failing:
            raise OSError("spool disk full")
        out.extend(to_wire(r) for r in records)

    bus = SnapshotBus()
    trail = AllocationTrail(TrailIdentity("c1", "n1", "s"), publish_durable=publish_durable)
    bus.publish(snapshot(1, inventory(), Attribution("current", (alloc("a", "GPU-n1-0"),))))
    with pytest.raises(OSError, match="spool disk full"):
        await run_emitter(bus.subscribe("allocations"), trail)
    # the open set counts the allocation, and its start is still owed (pending)
    assert trail.status()["open"] == 1
    assert [r["event"] for r in trail.allocations.pending] == ["start"]
    assert out == []
    failing = False
    task = asyncio.create_task(run_emitter(bus.subscribe("allocations"), trail))  # a restart
    bus.close()
    await asyncio.wait_for(task, 5)
    assert [(r["event"], r["pod"], r["start_observed"]) for r in out] == [("start", "a", False)]
    assert trail.allocations.pending == []
