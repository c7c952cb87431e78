"""One exporter's worker: intake queue → batcher → store (memory or disk spool) → sender.

While its sink delivers, a full store makes the batcher wait, the intake fills and `put` waits:
a slow sink slows the producer down and loses nothing. Once the sink fails (or the worker
makes no progress for one attempt's TIMEOUT), nothing waits any more: the oldest records are
dropped, counted and logged once per outage instead, so one sink never blocks the producer or
another exporter. The sender delivers the oldest stored batch, with retries; a batch leaves the
store only once delivered, so with the disk spool a crash or restart re-sends it.

The worker keeps its health from its own results (deliveries, store problems, and an idle-time
probe of the sink); `health()` is a plain read of that state, for handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth, Record
from gpuid_agent.delivery.store import BatchStore, MemoryBatches, StoredBatch
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError, ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.retry import RETRY_AFTER_CAP, backoff_delay

_log = log.get("pipeline")

_CLOSE: Any = object()  # queue sentinel: intake closed
STATES = ("ok", "degraded", "unavailable")


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
    health_probe_interval: float = 30.0


def memory_split(policy: BatchPolicy) -> tuple[int, int]:
    """QUEUE_SIZE bounds the records one exporter holds in memory: the intake and the batch
    being formed take half, batches in a memory store (or a spool that cannot be written)
    the other half. Returns (intake size, records in memory batches)."""
    half = policy.queue_size // 2
    return max(1, half - policy.batch_size), max(1, policy.queue_size - half)


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
            if oldest is not _CLOSE:
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
            if item is _CLOSE:
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
            if item is _CLOSE:
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
            delay = max(delay, min(self._retry_after, RETRY_AFTER_CAP))
        return delay

    async def deliver(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> Outcome:
        """Try a batch up to 1 + retry_count times."""
        meta = meta or BatchMeta.new()
        name = self.name
        attempts = 1 + self.policy.retry_count
        for attempt in range(attempts):
            if attempt:
                self._metrics.export_retries.labels(name).inc()
            self._last_attempt = time.monotonic()
            try:
                await self._attempt(batch, meta)
            except ExportError as exc:
                self._record_failure(exc.error_type, str(exc), exc.retry_after)
                if not exc.retryable:
                    return Outcome.REJECTED
            except Exception as exc:  # an exporter bug must not kill the worker
                self._record_failure(type(exc).__name__, repr(exc), None)
            else:
                self._record_success(len(batch))
                return Outcome.DELIVERED
            if attempt + 1 < attempts:
                await asyncio.sleep(self._pause_for(attempt))
        return Outcome.FAILED

    def _record_success(self, count: int) -> None:
        if self.consecutive_failures:
            _log.info(
                "exporter delivering again",
                extra={"exporter": self.name, "failed_attempts": self.consecutive_failures},
            )
        self.consecutive_failures = 0
        self.last_error = None
        self._retry_after = None
        self._probe = None  # a delivery proves the sink
        self._last_attempt = time.monotonic()
        self.delivered_records += count
        self.dropped_since_success = 0
        self.last_success = time.time()
        self._metrics.export_success.labels(self.name).inc()
        self._metrics.exported_records.labels(self.name).inc(count)
        self._metrics.last_export_success.labels(self.name).set(self.last_success)
        self._refresh()

    def _record_failure(self, error_type: str, message: str, retry_after: float | None) -> None:
        self.consecutive_failures += 1
        self._room.set()  # a waiting batcher now drops the oldest instead of blocking
        self._taken.set()  # and a waiting producer stops waiting
        self.last_error = message
        self._retry_after = retry_after
        self._metrics.export_failure.labels(self.name, error_type).inc()
        # The first failure of an outage is a warning; the rest would repeat it every backoff.
        level = 30 if self.consecutive_failures == 1 else 10
        _log.log(
            level,
            "export attempt failed",
            extra={"exporter": self.name, "error_type": error_type, "error": message},
        )
        self._refresh()

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
            except Exception as exc:
                self._store_failed("load", exc)
                self.store.forget(batch)
                self._count_dropped(batch.count, "unreadable", "stored batch unreadable")
                return Outcome.REJECTED
            outcome = await self.deliver(records, batch.meta)
            if outcome is Outcome.DELIVERED:
                try:
                    await self.store.remove(batch)
                except Exception as exc:
                    # Delivered: never send it again from here, whatever its file became.
                    self._store_failed("remove", exc)
                    self.store.forget(batch)
            elif outcome is Outcome.REJECTED:
                await self._set_aside(batch, self.last_error or "rejected")
            return outcome
        finally:
            batch.in_flight = False
            self._room.set()
            self._after_store_op()

    async def _set_aside(self, batch: StoredBatch, why: str) -> None:
        try:
            kept, dropped = await self.store.set_aside(batch)
        except Exception as exc:
            self._store_failed("set-aside", exc)
            self.store.forget(batch)
            kept, dropped = False, []
        self._dropped(dropped)
        self.set_aside_batches += 1
        self._metrics.set_aside_batches.labels(self.name).inc()
        if not kept:
            self._count_dropped(batch.count, "rejected", "rejected batch dropped")
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

    def _next_stored(self) -> StoredBatch | None:
        batch = self.store.oldest()
        if batch is not None:
            try:
                self.store.prefetch_after(batch)
            except Exception as exc:  # read-ahead is an optimisation: the load reads again
                self._store_failed("read-ahead", exc)
        return batch

    async def _send_loop(self) -> None:
        cycle = 0
        while True:
            batch = self._next_stored()
            if batch is None:
                if self._batching_done:
                    return
                self._stored.clear()
                await self._stored.wait()
                continue
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
        on_disk = self.store.records - self.store.memory_records
        if on_disk:
            _log.warning(
                "undelivered batches stay in the spool for the next start",
                extra={"exporter": self.name, "records": on_disk},
            )
        left = self.store.memory_records + self._queue.qsize() + len(self._forming)
        if left:
            self.dropped_records += left
            self._metrics.dropped_records.labels(self.name, "shutdown").inc(left)
            _log.error(
                "undelivered records lost at shutdown (held in memory)",
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

    async def probe_loop(self) -> None:
        """Probe the sink every health_probe_interval, but only when no delivery was attempted
        within it: a delivery (or a failed one) already says how the sink is."""
        interval = self.policy.health_probe_interval
        while True:
            idle = time.monotonic() - self._last_attempt
            if idle < interval:
                await asyncio.sleep(interval - idle)
                continue
            self._last_attempt = time.monotonic()
            try:
                probe = await asyncio.wait_for(
                    self.exporter.health(), min(self.policy.timeout, interval)
                )
            except TimeoutError:
                probe = ExporterHealth(ok=False, reason="health check timed out")
            except Exception as exc:  # a probe bug must not end the prober
                probe = ExporterHealth(ok=False, reason=f"health check failed: {exc!r}")
            self._probe = probe
            self._refresh()

    def _compute(self) -> ExporterHealth:
        reasons: list[str] = []
        if self.consecutive_failures:
            reasons.append(self.last_error or "failing")
            if self.store.batches:
                reasons.append(f"{self.store.batches} batches held in {self.store.describe()}")
        elif self._probe is not None and not self._probe.ok:
            reasons.append(self._probe.reason or "health check failed")
        for problem in (self.store_problem, self.store.problem, self._store_error):
            if problem:
                reasons.append(problem)
        if self._stuck:
            reasons.append(f"intake not drained within {self.policy.timeout}s")
        if not reasons:
            return ExporterHealth(ok=True)
        return ExporterHealth(
            ok=False, reason="; ".join(reasons), losing=self.dropped_since_success > 0
        )

    def _refresh(self) -> None:
        health = self._compute()
        if health == self._health:
            return
        previous, self._health = self._health, health
        if health.state != previous.state:
            self._publish_state()
            if health.state == "ok":
                self._drops_logged = False
                _log.info("exporter ok again", extra={"exporter": self.name})
            else:
                _log.warning(
                    f"exporter {health.state}",
                    extra={"exporter": self.name, "reason": health.reason},
                )

    def _publish_state(self) -> None:
        for state, gauge in self._state_gauges.items():
            gauge.set(1 if state == self._health.state else 0)

    def health(self) -> ExporterHealth:
        """ok, degraded (failing or its store impaired, records held) or unavailable
        (failing and dropping records): the worker's own state, read without I/O."""
        self._refresh()  # the store's problem can change inside one of its operations
        return self._health

    def describe(self) -> dict[str, Any]:
        """This exporter's part of /status."""
        health = self.health()
        return {
            "name": self.name,
            "state": health.state,
            "reason": health.reason,
            "store": self.store.describe(),
            "durable": self.store.durable,
            "pending": self.pending,
            "memory_records": self.memory_records,
            "max_memory_records": self.max_memory_records,
            "stored_batches": self.store.batches,
            "stored_bytes": self.store.bytes,
            "delivered_records": self.delivered_records,
            "dropped_records": self.dropped_records,
            "set_aside_batches": self.set_aside_batches,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "last_success": self.last_success,
        }
