"""Where an exporter's undelivered batches wait: the store interface and the memory store.

Every store is bounded and drops its oldest batches when full, marking each dropped batch with
the reason; the caller counts and logs them. Stores never raise an OSError at their caller: a
filesystem failure becomes the store's `problem` (and memory fallback, in the disk spool), so
one broken disk degrades one exporter instead of stopping it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from gpuid_agent.delivery.exporters.base import BatchMeta, JoinLimits, StoredForm
from gpuid_agent.delivery.pending import JSON_LINES, Pending, StoredBatch
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import CorruptBatchError

__all__ = ["JSON_LINES", "BatchStore", "MemoryBatches", "StoredBatch", "coalesce", "trim_memory"]


class BatchStore(ABC):
    """Pending batches of one exporter, oldest first, within a size bound."""

    durable = False

    def __init__(self) -> None:
        self._pending = Pending()

    @abstractmethod
    async def add(self, records: list[AnyRecord]) -> list[StoredBatch]:
        """Store a new batch; return the batches dropped to stay within the bound."""

    @abstractmethod
    async def load(self, batch: StoredBatch) -> list[AnyRecord]: ...

    @abstractmethod
    async def remove(self, batch: StoredBatch) -> None: ...

    async def remove_all(self, batches: Sequence[StoredBatch]) -> None:
        """Remove delivered batches (a coalesced delivery's)."""
        for batch in batches:
            await self.remove(batch)

    async def settle(self) -> None:
        """Finish removals still running in the background."""
        return None

    @abstractmethod
    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        """Move a rejected batch out of the way: (its records were kept, batches dropped
        to make room for it)."""

    def forget(self, batch: StoredBatch) -> None:
        """Stop tracking a batch whatever became of its storage (delivered, or unreadable),
        so this process does not send it again."""
        self._pending.pop(batch.meta.batch_id)

    def oldest(self) -> StoredBatch | None:
        return self._pending.oldest()

    def head(self, new_first: bool) -> StoredBatch | None:
        """The next batch to send: with `new_first`, the oldest of those stored by this
        process, if any; else the oldest of all (a previous run's backlog first)."""
        return self._pending.head(new_first)

    def following(self, batch: StoredBatch) -> Iterator[StoredBatch]:
        """The batches queued after `batch` in its lane, oldest first."""
        return self._pending.following(batch)

    def prefetch_stored(self, batches: Sequence[StoredBatch]) -> None:
        """Start reading the next delivery's files while the current one is in flight."""
        return None

    async def load_joined(self, batches: Sequence[StoredBatch]) -> list[AnyRecord]:
        """The records of consecutive batches, in order, for one joined delivery."""
        return [record for batch in batches for record in await self.load(batch)]

    async def load_stored(self, batches: Sequence[StoredBatch]) -> list[bytes]:
        """The files of batches kept in an exporter's stored form, as written."""
        raise CorruptBatchError(f"{self.describe()} keeps no batches in a stored form")

    def prefetch_after(self, batch: StoredBatch) -> None:
        """Start reading the batch queued after `batch` while `batch` is being sent."""
        return None

    @abstractmethod
    def full(self, records: int) -> bool:
        """Whether adding `records` more would pass the bound (never for an empty store)."""

    @property
    def problem(self) -> str | None:
        """Why the store cannot currently keep batches as it should, if it cannot."""
        return None

    @property
    def batches(self) -> int:
        return len(self._pending)

    @property
    def records(self) -> int:
        return self._pending.records

    @property
    def memory_records(self) -> int:
        """Records held in process memory (all of them for a memory store)."""
        return self._pending.memory_records

    @property
    def bytes(self) -> int:
        return 0

    @property
    def newer_batches(self) -> int:
        """Batch files of a newer format left for the version that wrote them (a spool's)."""
        return 0

    def describe(self) -> str:
        return "memory"


class MemoryBatches(BatchStore):
    """Memory-only: at most `max_records` records pending; lost when the process ends."""

    def __init__(self, max_records: int) -> None:
        super().__init__()
        self.max_records = max(1, max_records)

    def full(self, records: int) -> bool:
        return bool(self._pending) and self.records + records > self.max_records

    async def add(self, records: list[AnyRecord]) -> list[StoredBatch]:
        batch = StoredBatch(BatchMeta.new(), len(records), records=records)
        self._pending.add(batch)
        return trim_memory(self._pending, batch, self.max_records, None, "buffer_full")

    async def load(self, batch: StoredBatch) -> list[AnyRecord]:
        return batch.records or []

    async def remove(self, batch: StoredBatch) -> None:
        self.forget(batch)

    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        self.forget(batch)
        return False, []


def coalesce(
    store: BatchStore, first: StoredBatch, limits: StoredForm | JoinLimits
) -> list[StoredBatch]:
    """`first` and the batches queued right after it in the same form (stored-form files,
    JSON-lines files, or records held in memory), within `limits`: what one delivery takes
    from a backlog."""
    group, records, size = [first], first.count, first.size
    in_memory = first.records is not None  # batches held as records join records only
    for batch in store.following(first):
        records += batch.count
        size += batch.size
        if (
            batch.form != first.form
            or (batch.records is not None) != in_memory
            or batch.in_flight
            or records > limits.max_records
            or size > limits.max_bytes
        ):
            break
        group.append(batch)
    return group


def trim_memory(
    pending: Pending,
    keep: StoredBatch,
    max_records: int,
    max_bytes: int | None,
    reason: str,
) -> list[StoredBatch]:
    """Drop the oldest batches held in memory (never `keep` nor one in flight) until those
    left hold at most `max_records` records and `max_bytes` bytes of payload."""
    dropped: list[StoredBatch] = []

    def over() -> bool:
        held = pending.memory_records
        return held > max_records or (max_bytes is not None and pending.memory_bytes > max_bytes)

    if not over():
        return dropped
    for candidate in [b for b in pending.values() if b.records is not None]:
        if not over():
            break
        if candidate is keep or candidate.in_flight:
            continue
        pending.pop(candidate.meta.batch_id)
        candidate.dropped_for = reason
        dropped.append(candidate)
    return dropped
