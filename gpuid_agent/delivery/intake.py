"""One exporter's worker, first half: intake queue → batcher → store (memory or disk spool).

While its sink delivers, a full store makes the batcher wait, the intake fills and `put` waits:
a slow sink slows the producer down and loses nothing. Once the sink fails (or the worker
makes no progress for one attempt's TIMEOUT), nothing waits any more: the oldest records are
dropped, counted and logged once per outage instead, so one sink never blocks the producer or
another exporter. `store_now` stores records past the flush interval, after whatever was
published before them, for callers that must know they are held before going on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuid_agent.delivery.exporters.base import Exporter, ExporterHealth, Record
from gpuid_agent.delivery.store import BatchStore, MemoryBatches, StoredBatch
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import AgentMetrics

_log = log.get("pipeline")

CLOSE: Any = object()  # queue sentinel: intake closed
STATES = ("ok", "degraded", "unavailable")


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    batch_size: int = 10
    flush_interval: float = 2.0
    queue_size: int = 10_000
    retry_count: int = 2
    timeout: float = 30.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    health_probe_interval: float = 30.0


def memory_split(policy: BatchPolicy) -> tuple[int, int]:
    """QUEUE_SIZE bounds the records one exporter holds in memory: the intake and the batch
    being formed take half, batches in a memory store (or a spool that cannot be written)
    the other half. Returns (intake size, records in memory batches)."""
    half = policy.queue_size // 2
    return max(1, half - policy.batch_size), max(1, policy.queue_size - half)


class WorkerIntake:
    """State of one exporter's worker, its intake and its batcher; `ExporterWorker` adds
    the sender and the health it keeps."""

    def __init__(
        self,
        exporter: Exporter,
        policy: BatchPolicy,
        metrics: AgentMetrics,
        *,
        store: BatchStore | None = None,
        store_problem: str | None = None,
    ) -> None:
        self.exporter = exporter
        # Exporters written before batch identities existed take the batch alone.
        self._pass_meta = "meta" in inspect.signature(exporter.export).parameters
        exporter.observe(metrics)
        self.policy = policy
        intake, in_store = memory_split(policy)
        self.store = store if store is not None else MemoryBatches(in_store)
        self.store_problem = store_problem  # why the spool could not be used, if it could not
        self._store_error: str | None = None  # a store operation that raised anyway
        self._metrics = metrics
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=intake)
        self._forming: list[Record] = []  # the batch being assembled from the intake
        self._store_lock = asyncio.Lock()  # one writer at a time keeps batches in order
        self._room = asyncio.Event()  # set when the store shrinks or the sink starts failing
        self._taken = asyncio.Event()  # set when the batcher takes from the intake
        self._closing = False
        self._closed = asyncio.Event()
        self._stored = asyncio.Event()
        self._batching_done = False
        self._stuck = False  # the intake was not drained within one attempt's timeout
        self._retry_after: float | None = None
        self._probe: ExporterHealth | None = None
        self._last_attempt = time.monotonic()
        self._drops_logged = False
        self.last_error: str | None = None
        self.last_success: float | None = None
        self.consecutive_failures = 0
        self.delivered_records = 0
        self.dropped_records = 0
        self.dropped_since_success = 0
        self.set_aside_batches = 0
        self.max_memory_records = 0
        name = exporter.name
        self._depth = metrics.queue_depth.labels(name)
        self._spool_bytes = metrics.spool_bytes.labels(name)
        self._spool_batches = metrics.spool_batches.labels(name)
        self._state_gauges = {s: metrics.exporter_state.labels(name, s) for s in STATES}
        self._health = ExporterHealth(ok=True)
        self._publish_state()
        self._refresh()

    @property
    def name(self) -> str:
        return self.exporter.name

    @property
    def pending(self) -> int:
        """Records not yet delivered: waiting in the intake or stored in batches."""
        return self._queue.qsize() + len(self._forming) + self.store.records

    @property
    def memory_records(self) -> int:
        """Records held in process memory: the intake, the forming batch, memory batches."""
        return self._queue.qsize() + len(self._forming) + self.store.memory_records

    def _update_gauges(self) -> None:
        self._depth.set(self.pending)
        self._spool_bytes.set(self.store.bytes)
        self._spool_batches.set(self.store.batches if self.store.durable else 0)
        self.max_memory_records = max(self.max_memory_records, self.memory_records)

    # ---- intake ------------------------------------------------------------------------------

    def delivering(self) -> bool:
        """Whether waiting for this worker is backpressure rather than a hang."""
        return not self.consecutive_failures and not self._stuck

    async def put(self, record: Record) -> None:
        while self._queue.full() and self.delivering():
            self._taken.clear()  # set by the batcher taking records, or by a failure
            try:
                await asyncio.wait_for(self._taken.wait(), self.policy.timeout)
            except TimeoutError:
                self._stuck = True
                self._refresh()
        if self._queue.full():
            await asyncio.sleep(0)  # let a running batcher take what it can first
        if self._queue.full():
            oldest = self._queue.get_nowait()
            if oldest is not CLOSE:
                self._count_dropped(1, "intake_full", "oldest queued records dropped")
        self._queue.put_nowait(record)
        self._update_gauges()

    async def store_now(self, records: list[Record]) -> None:
        """Store `records` at once, past the flush interval, after whatever was published
        before them: when this returns they are in the store (fsync'd on disk, for a spool;
        in the bounded memory fallback when the spool cannot be written)."""
        try:
            await asyncio.wait_for(self._store_lock.acquire(), self.policy.timeout)
        except TimeoutError:
            self._stuck = True
            self._refresh()
            _log.error(
                "store busy past the timeout; records queued in memory",
                extra={"exporter": self.name, "records": len(records)},
            )
            for record in records:
                await self.put(record)
            return
        try:
            queued = self._forming + self._drain_intake()
            self._forming = []
            size = max(1, self.policy.batch_size)
            for start in range(0, len(queued), size):
                await self._add(queued[start : start + size])
            await self._add(list(records))
        finally:
            self._store_lock.release()

    def _drain_intake(self) -> list[Record]:
        out: list[Record] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is CLOSE:
                self._queue.put_nowait(item)  # the batcher still needs to see it
                break
            out.append(item)
        self._note_progress()
        return out

    def _note_progress(self) -> None:
        self._taken.set()
        if self._stuck:
            self._stuck = False
            self._refresh()

    # ---- batching ----------------------------------------------------------------------------

    async def _fill(self) -> None:
        """Gather up to batch_size records; wait at most flush_interval after the first."""
        deadline: float | None = None
        while len(self._forming) < self.policy.batch_size:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            elif deadline is None and not self._forming:
                item = await self._queue.get()
            else:
                if deadline is None:
                    deadline = time.monotonic() + self.policy.flush_interval
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            self._note_progress()
            if item is CLOSE:
                break
            self._forming.append(item)
            if deadline is None:
                deadline = time.monotonic() + (0 if self._closing else self.policy.flush_interval)

    async def _batch_loop(self) -> None:
        try:
            while not (self._closing and self._queue.empty() and not self._forming):
                await self._fill()
                # A delivering sink is waited for (backpressure); a failing one is not.
                while self.store.full(len(self._forming)) and self.delivering():
                    self._room.clear()
                    await self._room.wait()
                async with self._store_lock:
                    records, self._forming = self._forming, []
                    if records:
                        await self._add(records)
        finally:
            self._batching_done = True
            self._stored.set()

    async def _add(self, records: list[Record]) -> None:
        if not records:
            return
        try:
            dropped = await self.store.add(records)
        except Exception as exc:  # a store bug must not stop this exporter
            self._store_failed("add", exc)
            dropped = []
        else:
            self._store_error = None
        self._dropped(dropped)
        self._after_store_op()
        self._stored.set()

    def _dropped(self, batches: Sequence[StoredBatch]) -> None:
        by_reason: dict[str, int] = {}
        for batch in batches:
            reason = batch.dropped_for or "store_full"
            by_reason[reason] = by_reason.get(reason, 0) + batch.count
        for reason, count in by_reason.items():
            self._count_dropped(count, reason, "oldest batches dropped")

    def _count_dropped(self, count: int, reason: str, message: str) -> None:
        self.dropped_records += count
        self.dropped_since_success += count
        self._metrics.dropped_records.labels(self.name, reason).inc(count)
        if not self._drops_logged:  # once per outage; the counter has the rest
            self._drops_logged = True
            _log.error(
                message,
                extra={
                    "exporter": self.name,
                    "reason": reason,
                    "records": count,
                    "store": self.store.describe(),
                },
            )
        self._refresh()

    def _store_failed(self, op: str, exc: Exception) -> None:
        reason = f"store {op} failed: {exc}"
        if self._store_error != reason:
            _log.error(reason, extra={"exporter": self.name, "store": self.store.describe()})
        self._store_error = reason

    def _after_store_op(self) -> None:
        self._update_gauges()
        self._refresh()

    def _publish_state(self) -> None:
        for state, gauge in self._state_gauges.items():
            gauge.set(1 if state == self._health.state else 0)

    def _refresh(self) -> None:
        """Recompute health after a change (the sender's side defines it)."""
        raise NotImplementedError
