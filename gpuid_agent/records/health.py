"""`kind=health` records: one per check transition, in the same envelope as reading records.

Transitions are rare but each one matters, so they are queued (not coalesced like readings)
and published by their own task: the collector never waits on a slow exporter. The queue is
bounded; if an exporter outage outlasts it, the oldest transitions are dropped and counted.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from gpuid_agent.model import GpuIdentity, NodeInventory
from gpuid_agent.records.consume import follow
from gpuid_agent.records.serialize import rfc3339
from gpuid_agent.records.types import SCHEMA_VERSION, HealthRecord
from gpuid_agent.runtime import log
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.health.model import Transition
from gpuid_agent.state.health.workloads import holder_dict
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("health.records")


def health_record(
    transition: Transition, inventory: NodeInventory, gpu: GpuIdentity | None, *, source: str
) -> HealthRecord:
    current, previous = transition.current, transition.previous
    return HealthRecord(
        schema_version=SCHEMA_VERSION,
        kind="health",
        cluster=inventory.cluster,
        node=inventory.node,
        machine=inventory.machine,
        source=source,
        chassis=(gpu.chassis_serial if gpu else None) or "",
        gpu=(gpu.serial if gpu else None) or "",
        read_time=rfc3339(current.since),
        uuid=transition.uuid,
        index=transition.index,
        check=transition.check,
        state=current.state,
        previous_state=previous.state if previous else None,
        action=current.action,
        reason=current.reason,
        since=rfc3339(current.since),
        gpu_state=transition.gpu_state,
        machine_source=inventory.machine_source,
        holders=tuple(holder_dict(h) for h in transition.holders),
    )


def health_records(
    transitions: Iterable[Transition], inventory: NodeInventory, *, source: str
) -> list[HealthRecord]:
    gpus = inventory.gpu_by_uuid()
    return [
        health_record(t, inventory, gpus.get(t.uuid) if t.uuid else None, source=source)
        for t in transitions
    ]


class HealthPublisher:
    """Queue of health records drained into the pipeline by a supervised task."""

    def __init__(
        self,
        publish: Callable[[list[HealthRecord]], Awaitable[None]],
        *,
        limit: int = 10_000,
        source: str = "",
    ) -> None:
        self._publish = publish
        self._source = source
        self._queue: deque[HealthRecord] = deque()
        self._limit = limit
        self._wake = asyncio.Event()
        self._stopping = False
        self.dropped = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def offer(self, records: Iterable[HealthRecord]) -> None:
        for record in records:
            if len(self._queue) >= self._limit:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    _log.error(
                        "health records dropped: queue full", extra={"dropped": self.dropped}
                    )
            self._queue.append(record)
        self._wake.set()

    async def _drain(self) -> None:
        while self._queue:
            batch = list(self._queue)
            self._queue.clear()
            await self._publish(batch)

    async def run(self, subscription: Subscription | None = None) -> None:
        """With an `events=True` subscription, every snapshot's transitions become records
        (`source` as given to the constructor); the bus closing stops the publisher."""
        if subscription is None:
            await self._loop()
        else:
            await follow(subscription, self._offer_snapshot, self.stop, self._loop)

    def _offer_snapshot(self, snapshot: NodeSnapshot) -> None:
        self.offer(health_records(snapshot.transitions, snapshot.inventory, source=self._source))

    async def _loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            await self._drain()
        await self._drain()

    def stop(self) -> None:
        """Publish what is queued, then return."""
        self._stopping = True
        self._wake.set()
