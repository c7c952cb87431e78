"""One exporter's sender: the oldest stored batch first, with retries, until the store is empty.

A batch leaves the store only once delivered, so with the disk spool a crash or restart
re-sends it. A previous run's backlog and the batches stored since take turns, so new records
wait for one backlog delivery at most. Consecutive batches go out joined, so a backlog drains
in a few large deliveries: those kept in the exporter's stored form within the form's bounds,
those kept as records (JSON-lines files, or held in memory) within the exporter's join limits;
the next delivery's files are read while one is in flight. A batch the sink refuses (or that
cannot be read back) is set aside, never sent again and never lost silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter
from gpuid_agent.delivery.health_keeper import HealthKeeper
from gpuid_agent.delivery.intake import Intake
from gpuid_agent.delivery.policy import BatchPolicy
from gpuid_agent.delivery.store import JSON_LINES, BatchStore, StoredBatch, coalesce
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError, ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.runtime.retry import backoff_delay

_log = log.get("pipeline")


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"  # the sink refused the content; re-sending cannot help
    FAILED = "failed"  # the sink is unreachable or erring; worth retrying later


def joined_meta(group: Sequence[StoredBatch]) -> BatchMeta:
    """A joined delivery's identity: derived from all its batches' ids, so a retry of the same
    batches carries the same Idempotency-Key and a different set never reuses one."""
    if len(group) == 1:
        return group[0].meta
    digest = hashlib.blake2b(digest_size=16)
    for batch in group:
        digest.update(batch.meta.batch_id.encode())
    return BatchMeta(digest.hexdigest(), group[0].meta.created)


class Sender:
    def __init__(
        self,
        exporter: Exporter,
        store: BatchStore,
        *,
        intake: Intake,
        keeper: HealthKeeper,
        policy: BatchPolicy,
        metrics: AgentMetrics,
        changed: Callable[[], None],
    ) -> None:
        self._exporter = exporter
        self._store = store
        self._intake = intake
        self._keeper = keeper
        self._policy = policy
        self._metrics = metrics
        self._changed = changed  # after every store operation: gauges and health
        self._name = exporter.name
        self._new_first = False  # new batches' turn: the last delivery was from the backlog
        self._deadline: float | None = None  # set at shutdown (`stop_by`)
        self._last_took = 0.0  # how long the last delivery took, retries included

    def pause(self, attempt: int) -> float:
        """The backoff before retry `attempt`, never shorter than the sink's Retry-After."""
        policy = self._policy
        return backoff_delay(
            attempt, policy.backoff_base, policy.backoff_max, floor=self._keeper.retry_after
        )

    # ---- one delivery ------------------------------------------------------------------------

    async def deliver(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> Outcome:
        """Try a batch up to 1 + retry_count times."""
        given = meta or BatchMeta.new()

        return await self._deliver(lambda: self._exporter.export(batch, given), len(batch))

    async def _attempt(self, send: Callable[[], Awaitable[None]]) -> None:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(send(), self._policy.timeout)
        except TimeoutError as exc:
            raise ExportError(
                f"export timed out after {self._policy.timeout}s", error_type="timeout"
            ) from exc
        finally:
            self._metrics.export_duration.labels(self._name).observe(time.perf_counter() - started)

    async def _deliver(self, send: Callable[[], Awaitable[None]], count: int) -> Outcome:
        attempts = 1 + self._policy.retry_count
        for attempt in range(attempts):
            if attempt:
                self._metrics.export_retries.labels(self._name).inc()
            self._keeper.attempted()
            try:
                await self._attempt(send)
            except ExportError as exc:
                self._keeper.failed(exc.error_type, str(exc), exc.retry_after)
                if not exc.retryable:
                    return Outcome.REJECTED
            except Exception as exc:  # an exporter bug must not kill the worker
                self._keeper.failed(type(exc).__name__, repr(exc), None)
            else:
                self._keeper.succeeded(count)
                return Outcome.DELIVERED
            if attempt + 1 < attempts:
                await asyncio.sleep(self.pause(attempt))
        return Outcome.FAILED

    # ---- stored batches ----------------------------------------------------------------------

    async def _send(self, batch: StoredBatch) -> Outcome:
        form = self._exporter.stored_form
        store = self._store
        if form is not None and batch.records is None and batch.form == form.suffix:
            group = coalesce(store, batch, form)
            after = next(store.following(group[-1]), None)
            if after is not None and after.records is None and after.form == form.suffix:
                store.prefetch_stored(coalesce(store, after, form))
            outcome = await self._send_stored(group)
            if outcome is not Outcome.REJECTED or len(group) == 1:
                return outcome
            # One of them spoils the delivery: send each alone, so only that one is set aside.
            for single in group:
                outcome = await self._send_stored([single])
                if outcome is Outcome.FAILED:
                    return outcome
            return outcome
        limits = self._exporter.joins or (form if batch.records is not None else None)
        if limits is not None and (batch.records is not None or batch.form == JSON_LINES):
            group = coalesce(store, batch, limits)
            if len(group) > 1:
                after = next(store.following(group[-1]), None)
                if after is not None and after.records is None and after.form == JSON_LINES:
                    store.prefetch_stored(coalesce(store, after, limits))
                return await self._send_joined(group)
        return await self._send_records(batch)

    async def _send_joined(self, group: list[StoredBatch]) -> Outcome:
        """Batches kept as records (JSON-lines files, or held in memory), as one delivery."""
        for batch in group:
            batch.in_flight = True
        try:
            try:
                records = await self._store.load_joined(group)
            except CorruptBatchError:
                outcome = Outcome.REJECTED  # found below, one by one
            else:
                outcome = await self.deliver(records, joined_meta(group))
                if outcome is Outcome.DELIVERED:
                    await self._delivered(*group)
        finally:
            for batch in group:
                batch.in_flight = False
            self._store_changed()
        if outcome is Outcome.REJECTED:  # find the one the sink refuses, or that is unreadable
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
                payloads = await self._store.load_stored(group)
            except CorruptBatchError as exc:
                if len(group) > 1:
                    return Outcome.REJECTED  # the caller finds which one, one by one
                return await self._unreadable(group[0], exc)
            meta = group[0].meta
            outcome = await self._deliver(
                lambda: self._exporter.export_stored(payloads, meta), sum(b.count for b in group)
            )
            if outcome is Outcome.DELIVERED:
                await self._delivered(*group)
            elif outcome is Outcome.REJECTED and len(group) == 1:
                await self._set_aside(group[0], self._keeper.last_error or "rejected")
            return outcome
        finally:
            for batch in group:
                batch.in_flight = False
            self._store_changed()

    async def _send_records(self, batch: StoredBatch) -> Outcome:
        batch.in_flight = True
        try:
            try:
                records = await self._store.load(batch)
            except CorruptBatchError as exc:
                return await self._unreadable(batch, exc)
            except Exception as exc:
                self._keeper.store_failed("load", exc)
                self._store.forget(batch)
                self._keeper.count_dropped(batch.count, "unreadable", "stored batch unreadable")
                return Outcome.REJECTED
            outcome = await self.deliver(records, batch.meta)
            if outcome is Outcome.DELIVERED:
                await self._delivered(batch)
            elif outcome is Outcome.REJECTED:
                await self._set_aside(batch, self._keeper.last_error or "rejected")
            return outcome
        finally:
            batch.in_flight = False
            self._store_changed()

    def _store_changed(self) -> None:
        self._intake.made_room()
        self._changed()

    async def _unreadable(self, batch: StoredBatch, exc: Exception) -> Outcome:
        extra = {"exporter": self._name, "batch_id": batch.meta.batch_id, "error": str(exc)}
        _log.error("spooled batch unreadable; set aside", extra=extra)
        await self._set_aside(batch, f"unreadable: {exc}")
        return Outcome.REJECTED

    async def _delivered(self, *batches: StoredBatch) -> None:
        try:
            await self._store.remove_all(batches)
        except Exception as exc:
            # Delivered: never send them again from here, whatever their files became.
            self._keeper.store_failed("remove", exc)
            for batch in batches:
                self._store.forget(batch)

    async def _set_aside(self, batch: StoredBatch, why: str) -> None:
        try:
            kept, dropped = await self._store.set_aside(batch)
        except Exception as exc:
            self._keeper.store_failed("set-aside", exc)
            self._store.forget(batch)
            kept, dropped = False, []
        self._keeper.dropped(dropped)
        self._keeper.set_aside()
        if not kept:
            self._keeper.count_dropped(batch.count, "rejected", "rejected batch dropped")
        _log.error(
            "batch set aside",
            extra={
                "exporter": self._name,
                "batch_id": batch.meta.batch_id,
                "records": batch.count,
                "reason": why,
                "kept_in": str(batch.path) if kept and batch.path else None,
            },
        )

    # ---- the loop ----------------------------------------------------------------------------

    def _next_stored(self) -> StoredBatch | None:
        # New batches and a previous run's backlog take turns, so new records wait for one
        # backlog delivery at most, whatever its size.
        batch = self._store.head(self._new_first)
        if batch is not None:
            self._new_first = batch.backlog
            try:
                self._store.prefetch_after(batch)
            except Exception as exc:  # read-ahead is an optimisation: the load reads again
                self._keeper.store_failed("read-ahead", exc)
        return batch

    def stop_by(self, deadline: float) -> None:
        """Shutting down: start no delivery that may not end by `deadline` (monotonic) while
        what is left is on disk; it stays in the spool, whole, for the next start."""
        self._deadline = deadline

    def _out_of_time(self) -> bool:
        """Whether to leave the rest in the spool now: closing, everything stored, none of
        it only in memory, and too little time left for another delivery."""
        if self._deadline is None or not self._intake.finished or not self._store.durable:
            return False
        if self._store.memory_records:
            return False
        room = self._deadline - time.monotonic()
        return room < max(1.0, 2 * self._last_took)

    async def run(self) -> None:
        """Send until the intake has finished and the store is empty, or until the sink
        fails while the intake is closing, or shutdown's time is up (`stop_by`)."""
        cycle = 0
        while True:
            if self._out_of_time():
                self.left_behind()
                return
            batch = self._next_stored()
            if batch is None:
                if self._intake.finished:
                    return
                await self._intake.wait_stored()
                continue
            started = time.monotonic()
            outcome = await self._send(batch)
            self._last_took = time.monotonic() - started
            if outcome is not Outcome.FAILED:
                cycle = 0
                continue
            if self._intake.closing:
                self.left_behind()
                return
            cycle += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._intake.wait_closed(), self.pause(cycle))

    def left_behind(self) -> None:
        """At shutdown with the sink still failing: say what stays behind."""
        store = self._store
        on_disk = store.records - store.memory_records
        if on_disk:
            _log.warning(
                "undelivered batches stay in the spool for the next start",
                extra={"exporter": self._name, "records": on_disk},
            )
        left = store.memory_records + self._intake.held
        if left:
            self._keeper.lost_at_shutdown(left)
            _log.error(
                "undelivered records lost at shutdown (held in memory)",
                extra={"exporter": self._name, "records": left},
            )
