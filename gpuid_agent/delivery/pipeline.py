"""Typed records → one worker per exporter (intake, store, sender, health): the fan-out.

Each exporter has its own intake, batcher, store, retry state, health and metrics
(`delivery.worker`), so one failing sink or disk slows or stops no other exporter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from gpuid_agent.delivery.exporters.base import Exporter, ExporterHealth
from gpuid_agent.delivery.policy import BatchPolicy, memory_split
from gpuid_agent.delivery.sender import Outcome
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.delivery.store import BatchStore
from gpuid_agent.delivery.worker import ExporterWorker
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log
from gpuid_agent.runtime.metrics import AgentMetrics

__all__ = ["BatchPolicy", "ExporterWorker", "Outcome", "Pipeline", "build_pipeline"]

_log = log.get("pipeline")


class Pipeline:
    """Fan-out of records to every exporter's worker.

    Readiness policy: an exporter that fails while its records are held (spool, or room in
    memory) is degraded and does not make the agent unready; the agent is unready for export
    reasons only when every exporter is unavailable (failing and dropping records).
    """

    def __init__(self, workers: Sequence[ExporterWorker], metrics: AgentMetrics) -> None:
        self.workers = list(workers)
        self._metrics = metrics

    async def publish(self, records: Sequence[AnyRecord]) -> None:
        """Hand records to every worker; waits only on a worker that is delivering normally
        (backpressure), never on a failing or stuck one."""
        emitted = self._metrics.records_emitted
        for record in records:
            emitted.labels(record.kind).inc()
            for worker in self.workers:
                await worker.put(record)

    async def publish_durable(self, records: Sequence[AnyRecord]) -> None:
        """Hand `records` to every exporter's store now, after what `publish` sent before,
        and return once each holds them: written and fsync'd in a disk spool, or kept by a
        memory store (whose /status says `durable: false`; so is a spool's memory fallback
        while its disk fails). State that assumes the records were sent is saved only after
        this returns, so a crash in between re-sends them instead of losing them."""
        if not records:
            return
        for record in records:
            self._metrics.records_emitted.labels(record.kind).inc()
        await asyncio.gather(*(w.store_now(list(records)) for w in self.workers))

    def health(self) -> dict[str, ExporterHealth]:
        """Each exporter's health as its worker keeps it: a plain read, no I/O."""
        return {w.name: w.health() for w in self.workers}

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
    share of spool_max_bytes. While a spool cannot be written, the batches it keeps in memory
    are bounded like a memory store's (QUEUE_SIZE, half of it beside the intake)."""
    if not spool_dir:
        _log.warning(
            "running memory-only: undelivered batches are lost on restart (set SPOOL_DIR)",
            extra={"exporters": [e.name for e in exporters]},
        )
    share = spool_max_bytes // max(1, len(exporters))
    _, in_memory = memory_split(policy)
    workers: list[ExporterWorker] = []
    for exporter in exporters:
        store: BatchStore | None = None
        problem: str | None = None
        if spool_dir:
            try:
                store = DiskSpool(
                    Path(spool_dir) / exporter.name,
                    share,
                    memory_limit=in_memory,
                    form=exporter.stored_form,
                )
            except OSError as exc:
                problem = f"spool unusable, memory-only: {exc}"
                _log.error(problem, extra={"exporter": exporter.name})
        workers.append(
            ExporterWorker(exporter, policy, metrics, store=store, store_problem=problem)
        )
    return Pipeline(workers, metrics)
