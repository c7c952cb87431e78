"""One exporter's pending batches: an ordered index with running sums, in two lanes.

The sums (records, and records and payload bytes held in process memory) are kept as batches
come and go, so a delivery costs the same with ten pending batches or a hundred thousand.
Batches a disk spool found at start (a previous run's backlog) wait in their own lane beside
those stored since: the sender takes from both in turn, so new records are never stuck behind
a backlog, and each lane stays oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.records.types import AnyRecord

JSON_LINES = "ndjson"
# Backlog batches held as objects at a time (about 1 KB each): enough for the largest joined
# delivery and the one read ahead, whatever the backlog's size.
WINDOW = 4096


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
    backlog: bool = False  # found in the spool at start: waits in the backlog lane


class Pending:
    """Batches by id, the backlog lane's oldest first, then the new lane's oldest first.

    A batch's count, size and whether it is held in memory must not change while it is
    indexed (remove it, change it, add it again): the sums assume so. A backlog given by
    `feed` is counted at once but taken into the backlog lane `WINDOW` batches at a time."""

    def __init__(self) -> None:
        self._backlog: OrderedDict[str, StoredBatch] = OrderedDict()
        self._new: OrderedDict[str, StoredBatch] = OrderedDict()
        self._source: Iterator[StoredBatch] | None = None
        self._unread = 0  # batches of the source not yet in the backlog lane
        self.records = 0
        self.memory_records = 0
        self.memory_bytes = 0

    def feed(self, backlog: Iterable[StoredBatch], batches: int, records: int) -> None:
        """Take a backlog of `batches` batches holding `records` records, oldest first."""
        self._source = iter(backlog)
        self._unread, self.records = batches, self.records + records
        self._refill()

    def _refill(self) -> None:
        while self._source is not None and len(self._backlog) < WINDOW:
            batch = next(self._source, None)
            if batch is None:
                self._source, self._unread = None, 0
                break
            self._unread -= 1
            self.records -= batch.count  # counted since `feed`; `add` counts it again
            self.add(batch)

    def _lane(self, batch: StoredBatch) -> OrderedDict[str, StoredBatch]:
        return self._backlog if batch.backlog else self._new

    def add(self, batch: StoredBatch) -> None:
        lane = self._lane(batch)
        if batch.meta.batch_id in lane:
            return
        lane[batch.meta.batch_id] = batch
        self.records += batch.count
        if batch.records is not None:
            self.memory_records += batch.count
            self.memory_bytes += batch.size

    def pop(self, batch_id: str) -> StoredBatch | None:
        batch = self._backlog.pop(batch_id, None) or self._new.pop(batch_id, None)
        if batch is not None:
            self.records -= batch.count
            if batch.records is not None:
                self.memory_records -= batch.count
                self.memory_bytes -= batch.size
            if batch.backlog and len(self._backlog) < WINDOW // 2:
                self._refill()
        return batch

    def __len__(self) -> int:
        return len(self._backlog) + self._unread + len(self._new)

    def __contains__(self, batch_id: str) -> bool:
        return batch_id in self._backlog or batch_id in self._new

    def values(self) -> Iterator[StoredBatch]:
        """Every batch taken in, the backlog's oldest first (of a backlog fed, the window
        taken so far: its oldest batches)."""
        return chain(self._backlog.values(), self._new.values())

    def oldest(self) -> StoredBatch | None:
        return next(self.values(), None)

    def head(self, new_first: bool) -> StoredBatch | None:
        """The next batch to send: the new lane's oldest when `new_first` and there is one,
        else the oldest of all."""
        if new_first and self._new:
            return next(iter(self._new.values()))
        return self.oldest()

    def following(self, batch: StoredBatch) -> Iterator[StoredBatch]:
        """The batches queued after `batch` in its lane, oldest first (cheap for a lane's
        head, which is what the sender asks about)."""
        found = False
        for candidate in self._lane(batch).values():
            if found:
                yield candidate
            elif candidate is batch:
                found = True
