"""Publish one snapshot to many consumers, none of which can hold the others up.

Each subscription is a one-slot mailbox: `publish` never blocks and never waits on a consumer;
a consumer that is still busy with an older snapshot finds only the newest one when it comes
back (intermediate states coalesce). Consumers that must see every snapshot's events (health
transitions) read them from `NodeSnapshot.transitions` through `events=True`, which keeps a
bounded queue of the snapshots that carried any.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from gpuid_agent.runtime import log
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("bus")
EVENTS_LIMIT = 10_000


class Subscription:
    def __init__(self, name: str, *, events: bool = False, limit: int = EVENTS_LIMIT) -> None:
        self.name = name
        self.events = events
        self._latest: NodeSnapshot | None = None
        self._queue: deque[NodeSnapshot] = deque()
        self._limit = limit
        self._wake = asyncio.Event()
        self._closed = False
        self.coalesced = 0
        self.dropped = 0

    def offer(self, snapshot: NodeSnapshot) -> None:
        if self.events:
            if not snapshot.transitions:
                return
            if len(self._queue) >= self._limit:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    _log.error("snapshot events dropped", extra={"consumer": self.name})
            self._queue.append(snapshot)
        else:
            if self._latest is not None:
                self.coalesced += 1
            self._latest = snapshot
        self._wake.set()

    def take(self) -> NodeSnapshot | None:
        """The next snapshot without waiting, or None."""
        if self.events:
            return self._queue.popleft() if self._queue else None
        snapshot, self._latest = self._latest, None
        return snapshot

    async def next(self) -> NodeSnapshot | None:
        """The next snapshot; None once the bus is closed and nothing is left."""
        while True:
            snapshot = self.take()
            if snapshot is not None:
                return snapshot
            if self._closed:
                return None
            self._wake.clear()
            await self._wake.wait()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def __aiter__(self) -> AsyncIterator[NodeSnapshot]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[NodeSnapshot]:
        while (snapshot := await self.next()) is not None:
            yield snapshot

    async def feed(self, consumer: Callable[[NodeSnapshot], object]) -> None:
        """Hand each snapshot to a consumer that only takes note (never blocks), until the
        bus closes."""
        async for snapshot in self:
            consumer(snapshot)


class SnapshotBus:
    def __init__(self) -> None:
        self._subscriptions: list[Subscription] = []
        self.latest: NodeSnapshot | None = None

    def subscribe(self, name: str, *, events: bool = False) -> Subscription:
        sub = Subscription(name, events=events)
        self._subscriptions.append(sub)
        if self.latest is not None:
            sub.offer(self.latest)
        return sub

    def publish(self, snapshot: NodeSnapshot) -> None:
        self.latest = snapshot
        for sub in self._subscriptions:
            sub.offer(snapshot)

    def close(self) -> None:
        """No more snapshots: each consumer drains what it holds, then its loop ends."""
        for sub in self._subscriptions:
            sub.close()
