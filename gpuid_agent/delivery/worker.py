"""One exporter's worker, second half: the sender (oldest stored batch first, with retries) and
the health it keeps from its own results.

A batch leaves the store only once delivered, so with the disk spool a crash or restart
re-sends it. Health comes from deliveries, store problems and an idle-time probe of the sink
(`probe_loop`); `health()` is a plain read of that state, for handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gpuid_agent.delivery.exporters.base import BatchMeta, ExporterHealth, Record
from gpuid_agent.delivery.intake import CLOSE, BatchPolicy, WorkerIntake, memory_split
from gpuid_agent.delivery.store import StoredBatch, coalesce
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError, ExportError
from gpuid_agent.runtime.retry import RETRY_AFTER_CAP, backoff_delay

__all__ = ["BatchPolicy", "ExporterWorker", "Outcome", "memory_split"]

_log = log.get("pipeline")


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"  # the sink refused the content; re-sending cannot help
    FAILED = "failed"  # the sink is unreachable or erring; worth retrying later


class ExporterWorker(WorkerIntake):
    # ---- delivery ----------------------------------------------------------------------------

    async def _attempt(self, send: Callable[[], Awaitable[None]]) -> None:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(send(), self.policy.timeout)
        except TimeoutError as exc:
            raise ExportError(
                f"export timed out after {self.policy.timeout}s", error_type="timeout"
            ) from exc
        finally:
            self._metrics.export_duration.labels(self.name).observe(time.perf_counter() - started)

    def _pause_for(self, attempt: int) -> float:
        delay = backoff_delay(attempt, self.policy.backoff_base, self.policy.backoff_max)
        if self._retry_after is not None:
            delay = max(delay, min(self._retry_after, RETRY_AFTER_CAP))
        return delay

    async def deliver(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> Outcome:
        """Try a batch up to 1 + retry_count times."""
        given = meta or BatchMeta.new()

        def send() -> Awaitable[None]:
            if self._pass_meta:
                return self.exporter.export(batch, given)
            return self.exporter.export(batch)

        return await self._deliver(send, len(batch))

    async def _deliver(self, send: Callable[[], Awaitable[None]], count: int) -> Outcome:
        name = self.name
        attempts = 1 + self.policy.retry_count
        for attempt in range(attempts):
            if attempt:
                self._metrics.export_retries.labels(name).inc()
            self._last_attempt = time.monotonic()
            try:
                await self._attempt(send)
            except ExportError as exc:
                self._record_failure(exc.error_type, str(exc), exc.retry_after)
                if not exc.retryable:
                    return Outcome.REJECTED
            except Exception as exc:  # an exporter bug must not kill the worker
                self._record_failure(type(exc).__name__, repr(exc), None)
            else:
                self._record_success(count)
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
        form = self.exporter.stored_form
        if form is not None and batch.records is None and batch.form == form.suffix:
            group = coalesce(self.store, batch, form)
            after = next(self.store.following(group[-1]), None)
            if after is not None and after.records is None and after.form == form.suffix:
                self.store.prefetch_stored(coalesce(self.store, after, form))
            outcome = await self._send_stored(group)
            if outcome is not Outcome.REJECTED or len(group) == 1:
                return outcome
            # One of them spoils the delivery: send each alone, so only that one is set aside.
            for single in group:
                outcome = await self._send_stored([single])
                if outcome is Outcome.FAILED:
                    return outcome
            return outcome
        if form is not None and batch.records is not None:
            group = coalesce(self.store, batch, form)
            if len(group) > 1:
                return await self._send_held(group)
        return await self._send_records(batch)

    async def _send_held(self, group: list[StoredBatch]) -> Outcome:
        """Batches held in memory as records (no spool, or an unwritable one), joined."""
        for batch in group:
            batch.in_flight = True
        try:
            records = [r for batch in group for r in batch.records or []]
            outcome = await self.deliver(records, group[0].meta)
            if outcome is Outcome.DELIVERED:
                await self._delivered(*group)
        finally:
            for batch in group:
                batch.in_flight = False
            self._room.set()
            self._after_store_op()
        if outcome is Outcome.REJECTED:  # find the one the sink refuses
            for single in group:
                outcome = await self._send_records(single)
                if outcome is Outcome.FAILED:
                    break
        return outcome

    async def _send_stored(self, group: list[StoredBatch]) -> Outcome:
        for batch in group:
            batch.in_flight = True
        try:
            try:
                payloads = await self.store.load_stored(group)
            except CorruptBatchError as exc:
                if len(group) > 1:
                    return Outcome.REJECTED  # the caller finds which one, one by one
                return await self._unreadable(group[0], exc)
            meta = group[0].meta
            outcome = await self._deliver(
                lambda: self.exporter.export_stored(payloads, meta), sum(b.count for b in group)
            )
            if outcome is Outcome.DELIVERED:
                await self._delivered(*group)
            elif outcome is Outcome.REJECTED and len(group) == 1:
                await self._set_aside(group[0], self.last_error or "rejected")
            return outcome
        finally:
            for batch in group:
                batch.in_flight = False
            self._room.set()
            self._after_store_op()

    async def _unreadable(self, batch: StoredBatch, exc: Exception) -> Outcome:
        extra = {"exporter": self.name, "batch_id": batch.meta.batch_id, "error": str(exc)}
        _log.error("spooled batch unreadable; set aside", extra=extra)
        await self._set_aside(batch, f"unreadable: {exc}")
        return Outcome.REJECTED

    async def _delivered(self, *batches: StoredBatch) -> None:
        try:
            await self.store.remove_all(batches)
        except Exception as exc:
            # Delivered: never send them again from here, whatever their files became.
            self._store_failed("remove", exc)
            for batch in batches:
                self.store.forget(batch)

    async def _send_records(self, batch: StoredBatch) -> Outcome:
        batch.in_flight = True
        try:
            try:
                records = await self.store.load(batch)
            except CorruptBatchError as exc:
                return await self._unreadable(batch, exc)
            except Exception as exc:
                self._store_failed("load", exc)
                self.store.forget(batch)
                self._count_dropped(batch.count, "unreadable", "stored batch unreadable")
                return Outcome.REJECTED
            outcome = await self.deliver(records, batch.meta)
            if outcome is Outcome.DELIVERED:
                await self._delivered(batch)
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
            await self.store.settle()
        except asyncio.CancelledError:
            self._left_behind()
            raise

    def close_intake(self) -> None:
        """No more records will come: flush what is queued without waiting for a full batch."""
        self._closing = True
        self._closed.set()
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(CLOSE)

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

    def health(self) -> ExporterHealth:
        """ok, degraded (failing or its store impaired, records held) or unavailable
        (failing and dropping records): the worker's own state, read without I/O."""
        return self._health  # recomputed by the worker after every result and store operation

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
