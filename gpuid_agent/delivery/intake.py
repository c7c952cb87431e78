"""One exporter's intake: a bounded queue, and the batcher that turns it into stored batches.

While the sink delivers, a full store makes the batcher wait, the queue fills and `put` waits:
a slow sink slows the producer down and loses nothing. Once the sink fails (or the intake is
not drained for one attempt's TIMEOUT), nothing waits any more: the oldest records are
dropped, counted and logged once per outage instead, so one sink never blocks the producer or
another exporter. `store_now` stores records past the flush interval, after whatever was
put before them, for callers that must know they are held before going on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from gpuid_agent.delivery.health_keeper import HealthKeeper
from gpuid_agent.delivery.policy import BatchPolicy, memory_split
from gpuid_agent.delivery.store import BatchStore
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log

_log = log.get("pipeline")


class _Close:
    """The queue's end marker: the intake was closed."""


_CLOSE = _Close()


class Intake:
    def __init__(
        self,
        store: BatchStore,
        policy: BatchPolicy,
        keeper: HealthKeeper,
        changed: Callable[[], None],
    ) -> None:
        self._store = store
        self._policy = policy
        self._keeper = keeper
        self._changed = changed  # after records came or went: the worker's gauges
        size, _ = memory_split(policy)
        self._queue: asyncio.Queue[AnyRecord | _Close] = asyncio.Queue(maxsize=size)
        self._forming: list[AnyRecord] = []  # the batch being assembled from the queue
        self._store_lock = asyncio.Lock()  # one writer at a time keeps batches in order
        self._room = asyncio.Event()  # set when the store shrinks or the sink starts failing
        self._taken = asyncio.Event()  # set when the batcher takes from the queue
        self._stored = asyncio.Event()  # set when a batch was stored, and when batching ends
        self._closed = asyncio.Event()
        self.finished = False  # the batcher stored everything and returned

    @property
    def held(self) -> int:
        """Records not yet in the store: queued, or in the batch being formed."""
        return self._queue.qsize() + len(self._forming)

    @property
    def closing(self) -> bool:
        return self._closed.is_set()

    def release(self) -> None:
        """The sink failed: a waiting batcher drops the oldest instead of blocking, and a
        waiting producer stops waiting."""
        self._room.set()
        self._taken.set()

    def made_room(self) -> None:
        """The store shrank (or a send ended): a batcher waiting for room looks again."""
        self._room.set()

    async def wait_stored(self) -> None:
        """Until the next batch is stored (or batching ends)."""
        self._stored.clear()
        await self._stored.wait()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # ---- producers ---------------------------------------------------------------------------

    async def put(self, record: AnyRecord) -> None:
        while self._queue.full() and self._keeper.delivering():
            self._taken.clear()  # set by the batcher taking records, or by a failure
            try:
                await asyncio.wait_for(self._taken.wait(), self._policy.timeout)
            except TimeoutError:
                self._keeper.stuck(True)
        if self._queue.full():
            await asyncio.sleep(0)  # let a running batcher take what it can first
        if self._queue.full():
            oldest = self._queue.get_nowait()
            if oldest is not _CLOSE:
                self._keeper.count_dropped(1, "intake_full", "oldest queued records dropped")
        self._queue.put_nowait(record)
        self._changed()

    async def store_now(self, records: list[AnyRecord]) -> None:
        """Store `records` at once, past the flush interval, after whatever was put before
        them: when this returns they are in the store (fsync'd on disk, for a spool; in the
        bounded memory fallback when the spool cannot be written)."""
        try:
            await asyncio.wait_for(self._store_lock.acquire(), self._policy.timeout)
        except TimeoutError:
            self._keeper.stuck(True)
            _log.error(
                "store busy past the timeout; records queued in memory",
                extra={"exporter": self._keeper.name, "records": len(records)},
            )
            for record in records:
                await self.put(record)
            return
        try:
            queued = self._forming + self._drain()
            self._forming = []
            size = max(1, self._policy.batch_size)
            for start in range(0, len(queued), size):
                await self._add(queued[start : start + size])
            await self._add(list(records))
        finally:
            self._store_lock.release()

    def close(self) -> None:
        """No more records will come: flush what is queued without waiting for a full batch."""
        self._closed.set()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSE)

    def _drain(self) -> list[AnyRecord]:
        out: list[AnyRecord] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Close):
                self._queue.put_nowait(item)  # the batcher still needs to see it
                break
            out.append(item)
        self._progress()
        return out

    def _progress(self) -> None:
        self._taken.set()
        self._keeper.stuck(False)

    # ---- batcher -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Batch until closed and drained; a delivering sink is waited for (backpressure),
        a failing one is not."""
        try:
            while not (self.closing and self._queue.empty() and not self._forming):
                await self._fill()
                while self._store.full(len(self._forming)) and self._keeper.delivering():
                    self._room.clear()
                    await self._room.wait()
                async with self._store_lock:
                    records, self._forming = self._forming, []
                    if records:
                        await self._add(records)
        finally:
            self.finished = True
            self._stored.set()

    async def _fill(self) -> None:
        """Gather up to batch_size records; wait at most flush_interval after the first."""
        deadline: float | None = None
        policy = self._policy
        while len(self._forming) < policy.batch_size:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            elif deadline is None and not self._forming:
                item = await self._queue.get()
            else:
                if deadline is None:
                    deadline = time.monotonic() + policy.flush_interval
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closing:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            self._progress()
            if isinstance(item, _Close):
                break
            self._forming.append(item)
            if deadline is None:
                deadline = time.monotonic() + (0 if self.closing else policy.flush_interval)

    async def _add(self, records: list[AnyRecord]) -> None:
        if not records:
            return
        try:
            dropped = await self._store.add(records)
        except Exception as exc:  # a store bug must not stop this exporter
            self._keeper.store_failed("add", exc)
            dropped = []
        else:
            self._keeper.store_ok()
        self._keeper.dropped(dropped)
        self._changed()
        self._keeper.refresh()
        self._stored.set()
