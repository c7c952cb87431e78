"""`kind=health` records: one per check transition, in the same envelope as reading records.

Transitions are rare but each one matters, so they are queued (not coalesced like readings):
the emitter reads an `events=True` subscription and publishes every transition it brought; the
collector never waits on a slow exporter. The queue is bounded; if an exporter outage outlasts
it, the oldest transitions are dropped and counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterable

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.runner import Emitter
from gpuid_agent.records.serialize import rfc3339
from gpuid_agent.records.types import HealthRecord, header
from gpuid_agent.runtime import log
from gpuid_agent.state.health.verdicts import Transition
from gpuid_agent.state.health.workloads import holder_dict
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("health.records")


def health_record(
    transition: Transition, inventory: NodeInventory, gpu: GpuIdentity | None, *, source: str
) -> HealthRecord:
    current, previous = transition.current, transition.previous
    return HealthRecord(
        kind="health",
        **header(inventory, gpu, source=source, read_time=rfc3339(current.since)),
        uuid=transition.uuid,
        index=transition.index,
        check=transition.check,
        state=current.state,
        previous_state=previous.state if previous else None,
        action=current.action,
        reason=current.reason,
        since=rfc3339(current.since),
        gpu_state=transition.gpu_state,
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


class HealthPublisher(Emitter):
    """Queue of health records, drained into the pipeline in one batch per flush."""

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
        self.dropped = 0

    def note(self, snapshot: NodeSnapshot) -> None:
        records = health_records(snapshot.transitions, snapshot.inventory, source=self._source)
        for record in records:
            if len(self._queue) >= self._limit:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    _log.error(
                        "health records dropped: queue full", extra={"dropped": self.dropped}
                    )
            self._queue.append(record)

    async def flush(self) -> None:
        if self._queue:
            batch = list(self._queue)
            self._queue.clear()
            await self._publish(batch)
