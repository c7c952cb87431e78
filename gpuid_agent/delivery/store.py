"""Where an exporter's undelivered batches wait: the store interface and the memory store.

Every store is bounded and drops its oldest batches when full, marking each dropped batch with
the reason; the caller counts and logs them. Stores never raise an OSError at their caller: a
filesystem failure becomes the store's `problem` (and memory fallback, in the disk spool), so
one broken disk degrades one exporter instead of stopping it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta, StoredForm
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import CorruptBatchError

JSON_LINES = "ndjson"


@dataclass(slots=True, eq=False)
class StoredBatch:
    meta: BatchMeta
    count: int
    size: int = 0  # bytes of its file, or of its encoded payload while held in memory
    records: list[AnyRecord] | None = None  # in memory (memory store, or a failed disk write)
    path: Path | None = None
    in_flight: bool = False
    dropped_for: str = ""  # why the store dropped it, once it did
    form: str = JSON_LINES  # how its file holds it: JSON lines, or the exporter's stored form


class BatchStore(ABC):
    """Pending batches of one exporter, oldest first, within a size bound."""

    durable = False

    def __init__(self) -> None:
        self._pending: OrderedDict[str, StoredBatch] = OrderedDict()

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
        self._pending.pop(batch.meta.batch_id, None)

    def oldest(self) -> StoredBatch | None:
        return next(iter(self._pending.values()), None)

    def following(self, batch: StoredBatch) -> Iterator[StoredBatch]:
        """The batches queued after `batch`, oldest first."""
        found = False
        for candidate in self._pending.values():
            if found:
                yield candidate
            elif candidate is batch:
                found = True

    def prefetch_stored(self, batches: Sequence[StoredBatch]) -> None:
        """Start reading the next delivery's files while the current one is in flight."""
        return None

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
        return sum(b.count for b in self._pending.values())

    @property
    def memory_records(self) -> int:
        """Records held in process memory (all of them for a memory store)."""
        return sum(b.count for b in self._pending.values() if b.records is not None)

    @property
    def bytes(self) -> int:
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
        self._pending[batch.meta.batch_id] = batch
        return trim_memory(self._pending, batch, self.max_records, None, "buffer_full")

    async def load(self, batch: StoredBatch) -> list[AnyRecord]:
        return batch.records or []

    async def remove(self, batch: StoredBatch) -> None:
        self.forget(batch)

    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        self.forget(batch)
        return False, []


def coalesce(store: BatchStore, first: StoredBatch, form: StoredForm) -> list[StoredBatch]:
    """`first` and the batches queued right after it in the same form (stored-form files, or
    records held in memory), within the form's bounds: what one delivery takes from a backlog."""
    group, records, size = [first], first.count, first.size
    in_memory = first.records is not None  # batches held as records join records only
    for batch in store.following(first):
        records += batch.count
        size += batch.size
        if (
            batch.form != first.form
            or (batch.records is not None) != in_memory
            or batch.in_flight
            or records > form.max_records
            or size > form.max_bytes
        ):
            break
        group.append(batch)
    return group


def trim_memory(
    pending: OrderedDict[str, StoredBatch],
    keep: StoredBatch,
    max_records: int,
    max_bytes: int | None,
    reason: str,
) -> list[StoredBatch]:
    """Drop the oldest batches held in memory (never `keep` nor one in flight) until those
    left hold at most `max_records` records and `max_bytes` bytes of payload."""
    held = [b for b in pending.values() if b.records is not None]
    records = sum(b.count for b in held)
    size = sum(b.size for b in held)
    dropped: list[StoredBatch] = []
    for candidate in held:
        if records <= max_records and (max_bytes is None or size <= max_bytes):
            break
        if candidate is keep or candidate.in_flight:
            continue
        del pending[candidate.meta.batch_id]
        records -= candidate.count
        size -= candidate.size
        candidate.dropped_for = reason
        dropped.append(candidate)
    return dropped
