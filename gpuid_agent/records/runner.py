"""The one loop that runs a record emitter from its `SnapshotBus` subscription.

An emitter notes each snapshot without blocking (`note`), then publishes what the snapshots
noted owe (`flush`). While a flush waits on a slow exporter, newer snapshots wait in the
subscription (one slot, or the events queue), so intermediate states coalesce instead of piling
up. An emitter may also ask for a timer (`next_tick`, `tick`): the reading heartbeat, the
allocation state refresh. When the bus closes, what the last snapshot owes is published and the
runner returns; a flush that raises ends it (the supervisor reports the task).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod

from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot


class Emitter(ABC):
    @abstractmethod
    def note(self, snapshot: NodeSnapshot) -> None:
        """Take note of a snapshot; never blocks."""

    @abstractmethod
    async def flush(self) -> None:
        """Publish what the snapshots noted so far owe (and, on the first call, what an earlier
        run left owed)."""

    def next_tick(self) -> float | None:
        """Seconds until `tick` is due; None: no timer."""
        return None

    async def tick(self) -> None:
        """The timer is due and no snapshot came meanwhile: by default, publish what is owed
        now (a heartbeat)."""
        await self.flush()


async def run_emitter(subscription: Subscription, emitter: Emitter) -> None:
    await emitter.flush()
    while True:
        try:
            async with asyncio.timeout(emitter.next_tick()):  # not wait_for: 3.11's eats a cancel
                snapshot = await subscription.next()
        except TimeoutError:
            await emitter.tick()
            continue
        if snapshot is None:  # the bus is closed and drained
            return
        while snapshot is not None:
            emitter.note(snapshot)
            snapshot = subscription.take()
        await emitter.flush()
