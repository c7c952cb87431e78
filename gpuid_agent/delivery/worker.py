"""One exporter's worker: its intake, store, sender and health keeper, composed.

Each exporter has its own, so one failing sink or disk slows or stops no other exporter:
records go `put` → `Intake` (bounded queue, batcher) → `BatchStore` (memory, or the disk
spool) → `Sender` (oldest batch first, retries) → the exporter, and `HealthKeeper` turns what
each of them sees into the exporter's health, metrics and /status part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth
from gpuid_agent.delivery.health_keeper import HealthKeeper
from gpuid_agent.delivery.intake import Intake
from gpuid_agent.delivery.policy import BatchPolicy, memory_split
from gpuid_agent.delivery.sender import Outcome, Sender
from gpuid_agent.delivery.store import BatchStore, MemoryBatches
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.metrics import AgentMetrics

__all__ = ["BatchPolicy", "ExporterWorker", "Outcome", "memory_split"]


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
        self.policy = policy
        exporter.bind_metrics(metrics)
        _, in_store = memory_split(policy)
        self.store = store if store is not None else MemoryBatches(in_store)
        name = exporter.name
        metrics.add_exporter(name)
        self._depth = metrics.queue_depth.labels(name)
        self._spool_bytes = metrics.spool_bytes.labels(name)
        self._spool_batches = metrics.spool_batches.labels(name)
        # a newer version's batches, left in the spool: found at start, unchanged after it
        metrics.spool_newer_batches.labels(name).set(self.store.newer_batches)
        self.max_memory_records = 0
        self._keeper = HealthKeeper(name, self.store, policy, metrics, store_problem=store_problem)
        self._intake = Intake(self.store, policy, self._keeper, self._update_gauges)
        self._keeper.on_failure(self._intake.release)
        self._sender = Sender(
            exporter,
            self.store,
            intake=self._intake,
            keeper=self._keeper,
            policy=policy,
            metrics=metrics,
            changed=self._store_op,
        )

    @property
    def name(self) -> str:
        return self.exporter.name

    @property
    def pending(self) -> int:
        """Records not yet delivered: waiting in the intake or stored in batches."""
        return self._intake.held + self.store.records

    @property
    def memory_records(self) -> int:
        """Records held in process memory: the intake, the forming batch, memory batches."""
        return self._intake.held + self.store.memory_records

    def _update_gauges(self) -> None:
        self._depth.set(self.pending)
        self._spool_bytes.set(self.store.bytes)
        self._spool_batches.set(self.store.batches if self.store.durable else 0)
        self.max_memory_records = max(self.max_memory_records, self.memory_records)

    def _store_op(self) -> None:
        self._update_gauges()
        self._keeper.refresh()

    # ---- records in --------------------------------------------------------------------------

    async def put(self, record: AnyRecord) -> None:
        """Queue one record; waits only while the sink delivers (backpressure)."""
        await self._intake.put(record)

    async def store_now(self, records: list[AnyRecord]) -> None:
        """Store `records` now, after whatever was put before them (see `Intake.store_now`)."""
        await self._intake.store_now(records)

    def close_intake(self, stop_by: float | None = None) -> None:
        """No more records will come: flush what is queued without waiting for a full batch.
        With `stop_by` (monotonic), a spool's sender starts no delivery it may not finish by
        then: what is left stays in the spool, never half-sent."""
        if stop_by is not None:
            self._sender.stop_by(stop_by)
        self._intake.close()

    # ---- records out -------------------------------------------------------------------------

    async def deliver(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> Outcome:
        """Send one batch now, with this worker's retries, outside the store."""
        return await self._sender.deliver(batch, meta)

    async def run(self) -> None:
        """Batch and deliver until closed and drained (or the sink fails during shutdown)."""
        try:
            async with asyncio.TaskGroup() as tasks:
                batcher = tasks.create_task(self._intake.run())
                await self._sender.run()
                batcher.cancel()
            await self.store.settle()
        except asyncio.CancelledError:
            self._sender.left_behind()
            raise

    async def probe_loop(self) -> None:
        """Probe the sink every health_probe_interval while no delivery says how it is."""
        await self._keeper.probe_loop(self.exporter.health, self.policy.health_probe_interval)

    # ---- state -------------------------------------------------------------------------------

    def health(self) -> ExporterHealth:
        """ok, degraded (failing or its store impaired, records held) or unavailable
        (failing and dropping records): the worker's own state, read without I/O."""
        return self._keeper.health

    def describe(self) -> dict[str, Any]:
        """This exporter's part of /status."""
        health = self.health()
        keeper = self._keeper
        return {
            "name": self.name,
            "state": health.state,
            "reason": health.reason,
            "figures": dict(health.figures),
            "store": self.store.describe(),
            "durable": self.store.durable,
            "pending": self.pending,
            "memory_records": self.memory_records,
            "max_memory_records": self.max_memory_records,
            "stored_batches": self.store.batches,
            "stored_bytes": self.store.bytes,
            "newer_format_batches": self.store.newer_batches,
            "delivered_records": keeper.delivered_records,
            "dropped_records": keeper.dropped_records,
            "set_aside_batches": keeper.set_aside_batches,
            "consecutive_failures": keeper.consecutive_failures,
            "last_error": keeper.last_error,
            "last_success": keeper.last_success,
        }
