"""The SnapshotBus: publish never waits on a consumer, a busy consumer finds only the newest
snapshot, event consumers see every snapshot that carried transitions, and closing drains."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuid_agent.facts import NodeInventory
from gpuid_agent.state.attribution.holders import UNAVAILABLE
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.health.verdicts import CheckStatus, NodeHealth, Transition
from gpuid_agent.state.snapshot import NodeSnapshot

INVENTORY = NodeInventory("n", "c", "m", "test", None, None, (), datetime(2026, 1, 1, tzinfo=UTC))


def transition(index: int) -> Transition:
    status = CheckStatus("healthy", None, "none", datetime(2026, 1, 1, tzinfo=UTC))
    return Transition(check="xid", current=status, previous=None, uuid=f"GPU-{index}", index=index)


def snapshot(seq: int, transitions: int = 0) -> NodeSnapshot:
    return NodeSnapshot(
        seq=seq,
        cause="collection",
        inventory=INVENTORY,
        samples={},
        health=NodeHealth(),
        attribution=UNAVAILABLE,
        transitions=tuple(transition(i) for i in range(transitions)),
    )


async def test_a_busy_consumer_finds_only_the_newest_snapshot() -> None:
    bus = SnapshotBus()
    sub = bus.subscribe("slow")
    for seq in range(1, 101):
        bus.publish(snapshot(seq))  # never waits: nobody reads meanwhile
    got = await sub.next()
    assert got is not None and got.seq == 100
    assert sub.coalesced == 99
    assert sub.take() is None


async def test_a_late_subscriber_starts_from_the_latest_snapshot() -> None:
    bus = SnapshotBus()
    bus.publish(snapshot(1))
    bus.publish(snapshot(2))
    got = await bus.subscribe("late").next()
    assert got is not None and got.seq == 2


async def test_event_consumers_see_every_snapshot_that_carried_transitions() -> None:
    bus = SnapshotBus()
    events = bus.subscribe("health", events=True)
    latest = bus.subscribe("render")
    for seq in range(1, 11):
        bus.publish(snapshot(seq, transitions=seq % 2))
    seen = []
    while (got := events.take()) is not None:
        seen.append(got.seq)
    assert seen == [1, 3, 5, 7, 9]
    got = latest.take()
    assert got is not None and got.seq == 10


async def test_closing_the_bus_drains_then_ends_every_consumer() -> None:
    bus = SnapshotBus()
    sub = bus.subscribe("c")
    seen: list[int] = []
    task = asyncio.create_task(sub.feed(lambda n: seen.append(n.seq)))
    bus.publish(snapshot(1))
    await asyncio.sleep(0)
    bus.publish(snapshot(2))
    bus.close()
    await asyncio.wait_for(task, 5)
    assert seen[-1] == 2
    assert await sub.next() is None


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=40))
def test_event_queue_is_bounded_and_keeps_the_newest(counts: list[int]) -> None:
    bus = SnapshotBus()
    sub = bus.subscribe("health", events=True)
    sub._limit = 5  # a small bound, to reach it
    for seq, count in enumerate(counts, start=1):
        bus.publish(snapshot(seq, count))
    carried = [seq for seq, count in enumerate(counts, start=1) if count]
    kept = []
    while (got := sub.take()) is not None:
        kept.append(got.seq)
    assert kept == carried[-5:]
    assert sub.dropped == max(0, len(carried) - 5)
