"""Records → intake queue → batcher → store (memory or disk spool) → sender, one per exporter.

Each exporter has its own intake, batcher, store, retry state and metrics. While its sink
delivers, a full store makes the batcher wait, the intake fills and `publish` waits: a slow
sink slows the producer down and loses nothing. Once the sink fails, the batcher no longer
waits: the oldest stored batches are dropped, counted and logged instead, so a dead sink never
blocks the producer (for longer than one attempt's TIMEOUT) or another exporter. The sender
delivers the oldest stored batch, with retries; a batch leaves the store only once delivered,
so with the disk spool (SPOOL_DIR) a crash or restart re-sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth, Record
from gpuid_agent.delivery.spool import BatchStore, DiskSpool, MemoryBatches, StoredBatch
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError, ExportError
from gpuid_agent.runtime.metrics import AgentMetrics

_log = log.get("pipeline")


_CLOSE: Any = object()  # queue sentinel: intake closed
RETRY_AFTER_MAX = 300.0  # the longest pause a sink's Retry-After may impose
HEALTH_TTL = 2.0  # seconds a sink's health probe result is reused (probes, /status polls)


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"  # the sink refused the content; re-sending cannot help
    FAILED = "failed"  # the sink is unreachable or erring; worth retrying later


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    batch_size: int = 10
    flush_interval: float = 2.0
    queue_size: int = 10_000
    retry_count: int = 2
    timeout: float = 30.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base·2^attempt)]."""
    return random.uniform(0, min(cap, base * (2**attempt)))


class ExporterWorker:
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
        self.policy = policy
        # QUEUE_SIZE bounds the records held in memory: half waits in the intake, half in
        # batches (memory-only mode).
        intake = max(1, policy.queue_size // 2)
        self.store = (
            store if store is not None else MemoryBatches(max(1, policy.queue_size - intake))
        )
        self.store_problem = store_problem  # why the spool could not be used, if it could not
        self._metrics = metrics
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=intake)
        self._room = asyncio.Event()  # set when the store shrinks or the sink starts failing
        self._closing = False
        self._closed = asyncio.Event()
        self._stored = asyncio.Event()
        self._batching_done = False
        self._retry_after: float | None = None
        self._health: tuple[float, ExporterHealth] | None = None
        self.last_error: str | None = None
        self.last_success: float | None = None
        self.consecutive_failures = 0
        self.delivered_records = 0
        self.dropped_records = 0
        self.dropped_since_success = 0
        self.set_aside_batches = 0
        name = exporter.name
        self._depth = metrics.queue_depth.labels(name)
        self._spool_bytes = metrics.spool_bytes.labels(name)
        self._spool_batches = metrics.spool_batches.labels(name)
        self._update_gauges()

    @property
    def name(self) -> str:
        return self.exporter.name

    @property
    def pending(self) -> int:
        """Records not yet delivered: waiting in the intake or stored in batches."""
        return self._queue.qsize() + self.store.records

    def _update_gauges(self) -> None:
        self._depth.set(self.pending)
        self._spool_bytes.set(self.store.bytes)
        self._spool_batches.set(self.store.batches if self.store.durable else 0)

    async def put(self, record: Record) -> None:
        await self._queue.put(record)
        self._depth.set(self.pending)

    async def store_now(self, records: list[Record]) -> None:
        """Store `records` as a batch of their own at once, past the intake and its flush
        interval: when this returns they are in the store (on disk, for a spool)."""
        dropped = await self.store.add(records)
        self._dropped(dropped, "spool_full" if self.store.durable else "buffer_full")
        self._update_gauges()
        self._stored.set()

    # ---- batching ----------------------------------------------------------------------------

    async def _next_batch(self) -> list[Record]:
        """Up to batch_size records; waits at most flush_interval after the first one."""
        batch: list[Record] = []
        deadline: float | None = None
        while len(batch) < self.policy.batch_size:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            elif deadline is None:
                item = await self._queue.get()
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if item is _CLOSE:
                break
            batch.append(item)
            if deadline is None:
                deadline = time.monotonic() + (0 if self._closing else self.policy.flush_interval)
        return batch

    async def _batch_loop(self) -> None:
        try:
            while not (self._closing and self._queue.empty()):
                records = await self._next_batch()
                if not records:
                    continue
                while self.store.full(len(records)) and not self.consecutive_failures:
                    self._room.clear()  # a delivering sink: wait for it (backpressure)
                    await self._room.wait()
                dropped = await self.store.add(records)
                self._dropped(dropped, "spool_full" if self.store.durable else "buffer_full")
                self._update_gauges()
                self._stored.set()
        finally:
            self._batching_done = True
            self._stored.set()

    def _dropped(self, batches: Sequence[StoredBatch], reason: str) -> None:
        if not batches:
            return
        count = sum(b.count for b in batches)
        self.dropped_records += count
        self.dropped_since_success += count
        self._metrics.dropped_records.labels(self.name, reason).inc(count)
        _log.error(
            "oldest batches dropped: store full",
            extra={
                "exporter": self.name,
                "reason": reason,
                "batches": len(batches),
                "records": count,
                "store": self.store.describe(),
            },
        )

    # ---- delivery ----------------------------------------------------------------------------

    async def _attempt(self, batch: Sequence[Record], meta: BatchMeta) -> None:
        name = self.name
        started = time.perf_counter()
        try:
            call = (
                self.exporter.export(batch, meta)
                if self._pass_meta
                else self.exporter.export(batch)
            )
            await asyncio.wait_for(call, self.policy.timeout)
        except TimeoutError as exc:
            raise ExportError(
                f"export timed out after {self.policy.timeout}s", error_type="timeout"
            ) from exc
        finally:
            self._metrics.export_duration.labels(name).observe(time.perf_counter() - started)

    def _pause_for(self, attempt: int) -> float:
        delay = backoff_delay(attempt, self.policy.backoff_base, self.policy.backoff_max)
        if self._retry_after is not None:
            delay = max(delay, min(self._retry_after, RETRY_AFTER_MAX))
        return delay

    async def deliver(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> Outcome:
        """Try a batch up to 1 + retry_count times."""
        meta = meta or BatchMeta.new()
        name = self.name
        attempts = 1 + self.policy.retry_count
        for attempt in range(attempts):
            if attempt:
                self._metrics.export_retries.labels(name).inc()
            try:
                await self._attempt(batch, meta)
            except ExportError as exc:
                self._record_failure(exc.error_type, str(exc), exc.retry_after)
                if not exc.retryable:
                    return Outcome.REJECTED
            except Exception as exc:  # an exporter bug must not kill the worker
                self._record_failure(type(exc).__name__, repr(exc), None)
            else:
                if self.consecutive_failures:
                    _log.info(
                        "exporter delivering again",
                        extra={"exporter": name, "failed_attempts": self.consecutive_failures},
                    )
                self.consecutive_failures = 0
                self.last_error = None
                self._retry_after = None
                self.delivered_records += len(batch)
                self.dropped_since_success = 0
                self.last_success = time.time()
                self._metrics.export_success.labels(name).inc()
                self._metrics.exported_records.labels(name).inc(len(batch))
                self._metrics.last_export_success.labels(name).set(self.last_success)
                return Outcome.DELIVERED
            if attempt + 1 < attempts:
                await asyncio.sleep(self._pause_for(attempt))
        return Outcome.FAILED

    def _record_failure(self, error_type: str, message: str, retry_after: float | None) -> None:
        self.consecutive_failures += 1
        self._room.set()  # a waiting batcher now drops the oldest instead of blocking
        self.last_error = message
        self._retry_after = retry_after
        self._health = None
        self._metrics.export_failure.labels(self.name, error_type).inc()
        # The first failure of an outage is a warning; the rest would repeat it every backoff.
        level = 30 if self.consecutive_failures == 1 else 10
        _log.log(
            level,
            "export attempt failed",
            extra={"exporter": self.name, "error_type": error_type, "error": message},
        )

    async def _send(self, batch: StoredBatch) -> Outcome:
        batch.in_flight = True
        try:
            try:
                records = await self.store.load(batch)
            except CorruptBatchError as exc:
                _log.error(
                    "spooled batch unreadable; set aside",
                    extra={
                        "exporter": self.name,
                        "batch_id": batch.meta.batch_id,
                        "error": str(exc),
                    },
                )
                await self._set_aside(batch, f"unreadable: {exc}")
                return Outcome.REJECTED
            outcome = await self.deliver(records, batch.meta)
            if outcome is Outcome.DELIVERED:
                await self.store.remove(batch)
            elif outcome is Outcome.REJECTED:
                await self._set_aside(batch, self.last_error or "rejected")
            return outcome
        finally:
            batch.in_flight = False
            self._room.set()
            self._update_gauges()

    async def _set_aside(self, batch: StoredBatch, why: str) -> None:
        kept, dropped = await self.store.set_aside(batch)
        self._dropped(dropped, "spool_full")
        self.set_aside_batches += 1
        self._metrics.set_aside_batches.labels(self.name).inc()
        if not kept:
            self.dropped_records += batch.count
            self._metrics.dropped_records.labels(self.name, "rejected").inc(batch.count)
        _log.error(
            "batch set aside",
            extra={
                "exporter": self.name,
                "batch_id": batch.meta.batch_id,
                "records": batch.count,
                "reason": why,
                "kept_in": str(batch.path) if kept and batch.path else None,
            },
        )

    async def _send_loop(self) -> None:
        cycle = 0
        while True:
            batch = self.store.oldest()
            if batch is None:
                if self._batching_done:
                    return
                self._stored.clear()
                await self._stored.wait()
                continue
            self.store.prefetch_after(batch)
            outcome = await self._send(batch)
            if outcome is not Outcome.FAILED:
                cycle = 0
                continue
            if self._closing:
                self._left_behind()
                return
            cycle += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), self._pause_for(cycle))

    def _left_behind(self) -> None:
        """At shutdown with the sink still failing: say what stays behind."""
        if self.store.durable:
            _log.warning(
                "undelivered batches stay in the spool for the next start",
                extra={
                    "exporter": self.name,
                    "batches": self.store.batches,
                    "records": self.store.records,
                },
            )
            return
        left = self.store.records + self._queue.qsize()
        if left:
            self.dropped_records += left
            self._metrics.dropped_records.labels(self.name, "shutdown").inc(left)
            _log.error(
                "undelivered records lost at shutdown (memory-only)",
                extra={"exporter": self.name, "records": left},
            )

    async def run(self) -> None:
        """Batch and deliver until closed and drained (or the sink fails during shutdown)."""
        try:
            async with asyncio.TaskGroup() as tasks:
                batcher = tasks.create_task(self._batch_loop())
                await self._send_loop()
                batcher.cancel()
        except asyncio.CancelledError:
            self._left_behind()
            raise

    def close_intake(self) -> None:
        """No more records will come: flush what is queued without waiting for a full batch."""
        self._closing = True
        self._closed.set()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSE)

    # ---- health ------------------------------------------------------------------------------

    def health_now(self) -> ExporterHealth:
        """The last known health, without probing."""
        if self.consecutive_failures:
            reason = self.last_error
            if self.store.batches:
                reason = f"{reason}; {self.store.batches} batches held in {self.store.describe()}"
            return ExporterHealth(ok=False, reason=reason, losing=self.dropped_since_success > 0)
        probe = self._health[1] if self._health else ExporterHealth(ok=True)
        if probe.ok and self.store_problem:
            return ExporterHealth(ok=False, reason=self.store_problem)
        return probe

    async def health(self) -> ExporterHealth:
        """ok, degraded (failing, records held) or unavailable (failing and dropping records)."""
        if self.consecutive_failures:
            reason = self.last_error
            if self.store.batches:
                reason = f"{reason}; {self.store.batches} batches held in {self.store.describe()}"
            return ExporterHealth(ok=False, reason=reason, losing=self.dropped_since_success > 0)
        now = time.monotonic()
        if self._health is None or now - self._health[0] > HEALTH_TTL:
            try:
                probe = await asyncio.wait_for(
                    self.exporter.health(), min(self.policy.timeout, 5.0)
                )
            except TimeoutError:
                probe = ExporterHealth(ok=False, reason="health check timed out")
            except Exception as exc:  # a probe bug must not fail /readyz with a 500
                probe = ExporterHealth(ok=False, reason=f"health check failed: {exc!r}")
            self._health = (now, probe)
        probe = self._health[1]
        if probe.ok and self.store_problem:
            return ExporterHealth(ok=False, reason=self.store_problem)
        return probe

    def describe(self) -> dict[str, Any]:
        """This exporter's part of /status."""
        return {
            "name": self.name,
            "store": self.store.describe(),
            "durable": self.store.durable,
            "pending": self.pending,
            "stored_batches": self.store.batches,
            "stored_bytes": self.store.bytes,
            "delivered_records": self.delivered_records,
            "dropped_records": self.dropped_records,
            "set_aside_batches": self.set_aside_batches,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_success": self.last_success,
        }


class Pipeline:
    """Fan-out of records to every exporter's worker.

    Readiness policy: an exporter that fails while its records are held (spool, or room in
    memory) is degraded and does not make the agent unready; the agent is unready for export
    reasons only when every exporter is unavailable (failing and dropping records).
    """

    def __init__(self, workers: Sequence[ExporterWorker], metrics: AgentMetrics) -> None:
        self.workers = list(workers)
        self._metrics = metrics

    async def publish(self, records: Sequence[Record]) -> None:
        for record in records:
            self._metrics.records_emitted.labels(record.get("kind", "unknown")).inc()
            for worker in self.workers:
                await worker.put(record)

    async def publish_durable(self, records: Sequence[Record]) -> None:
        """Hand `records` to every exporter's store now and return once each holds them:
        written and fsync'd in a disk spool, or kept by a memory-only store (whose /status
        says `durable: false`). State that assumes the records were sent is saved only after
        this returns, so a crash in between re-sends them instead of losing them."""
        if not records:
            return
        for record in records:
            self._metrics.records_emitted.labels(record.get("kind", "unknown")).inc()
        await asyncio.gather(*(w.store_now(list(records)) for w in self.workers))

    def health(self) -> dict[str, ExporterHealth]:
        healths = {w.name: w.health_now() for w in self.workers}
        for name, h in healths.items():
            for state in ("ok", "degraded", "unavailable"):
                self._metrics.exporter_state.labels(name, state).set(1 if h.state == state else 0)
        return healths

    @staticmethod
    def ready(healths: dict[str, ExporterHealth]) -> bool:
        return not healths or any(h.state != "unavailable" for h in healths.values())


def build_pipeline(
    exporters: Sequence[Exporter],
    policy: BatchPolicy,
    metrics: AgentMetrics,
    *,
    spool_dir: str = "",
    spool_max_bytes: int = 256 * 1024 * 1024,
) -> Pipeline:
    """One worker per exporter; with a spool dir each gets `<dir>/<exporter>` and an equal
    share of spool_max_bytes."""
    if not spool_dir:
        _log.warning(
            "running memory-only: undelivered batches are lost on restart (set SPOOL_DIR)",
            extra={"exporters": [e.name for e in exporters]},
        )
    share = spool_max_bytes // max(1, len(exporters))
    workers: list[ExporterWorker] = []
    for exporter in exporters:
        store: BatchStore | None = None
        problem: str | None = None
        if spool_dir:
            try:
                store = DiskSpool(Path(spool_dir) / exporter.name, share)
            except OSError as exc:
                problem = f"spool unusable, memory-only: {exc}"
                _log.error(problem, extra={"exporter": exporter.name})
        workers.append(
            ExporterWorker(exporter, policy, metrics, store=store, store_problem=problem)
        )
    return Pipeline(workers, metrics)
