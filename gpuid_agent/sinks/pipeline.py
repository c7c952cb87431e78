"""Records → bounded queue → batcher → exporter, one worker per exporter.

Each exporter has its own queue, batcher and retry state. `publish` waits for queue space, so a
slow exporter slows the producer down rather than growing memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuid_agent import log
from gpuid_agent.errors import ExportError
from gpuid_agent.metrics import AgentMetrics
from gpuid_agent.sinks.exporters.base import Exporter, ExporterHealth, Record

_log = log.get("pipeline")


_CLOSE: Any = object()  # queue sentinel: intake closed


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    REJECTED = "rejected"  # the sink refused the content; re-sending cannot help
    FAILED = "failed"  # the sink is unreachable or erring; worth retrying later


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    batch_size: int = 10
    flush_interval: float = 5.0
    queue_size: int = 10_000
    retry_count: int = 2
    timeout: float = 30.0
    backoff_base: float = 0.5
    backoff_max: float = 30.0


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base·2^attempt)]."""
    return random.uniform(0, min(cap, base * (2**attempt)))


class ExporterWorker:
    def __init__(self, exporter: Exporter, policy: BatchPolicy, metrics: AgentMetrics) -> None:
        self.exporter = exporter
        self.policy = policy
        self._metrics = metrics
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=policy.queue_size)
        self._closing = False
        self.last_error: str | None = None
        self.consecutive_failures = 0
        self.delivered_records = 0
        self._depth = metrics.queue_depth.labels(exporter.name)

    @property
    def name(self) -> str:
        return self.exporter.name

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def put(self, record: Record) -> None:
        await self._queue.put(record)
        self._depth.set(self._queue.qsize())

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
        self._depth.set(self._queue.qsize())
        return batch

    async def _attempt(self, batch: Sequence[Record]) -> None:
        name = self.name
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.exporter.export(batch), self.policy.timeout)
        except TimeoutError as exc:
            raise ExportError(
                f"export timed out after {self.policy.timeout}s", error_type="timeout"
            ) from exc
        finally:
            self._metrics.export_duration.labels(name).observe(time.perf_counter() - started)

    async def deliver(self, batch: Sequence[Record]) -> Outcome:
        """Try a batch up to 1 + retry_count times."""
        name = self.name
        attempts = 1 + self.policy.retry_count
        for attempt in range(attempts):
            try:
                await self._attempt(batch)
            except ExportError as exc:
                self._record_failure(exc.error_type, str(exc))
                if not exc.retryable:
                    return Outcome.REJECTED
            except Exception as exc:  # an exporter bug must not kill the worker
                self._record_failure(type(exc).__name__, repr(exc))
            else:
                self.consecutive_failures = 0
                self.last_error = None
                self.delivered_records += len(batch)
                self._metrics.export_success.labels(name).inc()
                self._metrics.exported_records.labels(name).inc(len(batch))
                self._metrics.last_export_success.labels(name).set(time.time())
                return Outcome.DELIVERED
            if attempt + 1 < attempts:
                await asyncio.sleep(
                    backoff_delay(attempt, self.policy.backoff_base, self.policy.backoff_max)
                )
        return Outcome.FAILED

    def _record_failure(self, error_type: str, message: str) -> None:
        self.consecutive_failures += 1
        self.last_error = message
        self._metrics.export_failure.labels(self.name, error_type).inc()
        _log.warning(
            "export attempt failed",
            extra={"exporter": self.name, "error_type": error_type, "error": message},
        )

    async def run(self) -> None:
        """Deliver batches until closed and drained.

        A batch that fails a whole attempt cycle is retried after a pause, in order, so a sink
        outage holds records in the queue (bounded) instead of losing them."""
        while not (self._closing and self._queue.empty()):
            batch = await self._next_batch()
            if not batch:
                continue
            cycle = 0
            while (outcome := await self.deliver(batch)) is Outcome.FAILED and not self._closing:
                cycle += 1
                await asyncio.sleep(backoff_delay(cycle, 1.0, self.policy.backoff_max))
            if outcome is not Outcome.DELIVERED:
                reason = "rejected" if outcome is Outcome.REJECTED else "shutdown"
                self._metrics.dropped_records.labels(self.name, reason).inc(len(batch))
                _log.error(
                    "batch set aside",
                    extra={"exporter": self.name, "records": len(batch), "reason": reason},
                )

    def close_intake(self) -> None:
        """No more records will come: flush what is queued without waiting for a full batch."""
        self._closing = True
        with contextlib.suppress(asyncio.QueueFull):
            self._queue.put_nowait(_CLOSE)

    async def health(self) -> ExporterHealth:
        if self.consecutive_failures:
            return ExporterHealth(ok=False, reason=self.last_error)
        return await self.exporter.health()


class Pipeline:
    """Fan-out of records to every exporter's worker."""

    def __init__(self, workers: Sequence[ExporterWorker], metrics: AgentMetrics) -> None:
        self.workers = list(workers)
        self._metrics = metrics

    async def publish(self, records: Sequence[Record]) -> None:
        for record in records:
            self._metrics.records_emitted.labels(record.get("kind", "unknown")).inc()
            for worker in self.workers:
                await worker.put(record)

    async def health(self) -> dict[str, ExporterHealth]:
        return {w.name: await w.health() for w in self.workers}
