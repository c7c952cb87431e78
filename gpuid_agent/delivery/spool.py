"""The durable spool (SPOOL_DIR): one file per batch, written before the first delivery attempt.

Each batch is written to a hidden temporary name, fsync'd, renamed into place (atomic), and the
directory fsync'd, so a crash leaves either the whole batch or nothing; a failed write removes
what it wrote (`SpoolFiles` does the file work). A delivered batch's file is removed; files
left behind by a previous run are re-sent, oldest first. The form is `ndjson` (the records'
wire form as JSON lines, read back into typed records), or the exporter's own stored form when
it has one (PostgreSQL: COPY text), encoded when the batch is written so a backlog has nothing
left to convert; files of either form are re-sent, whichever the exporter writes now. Batches a
sink rejected move to `rejected/` for an operator to inspect or replay. Batch files of a newer
format than this version reads (a rollback) stay where they are, outside the spool's bound, for
the newer version to send; the start that finds them says so once.

When the disk fails (full, read-only, gone), nothing raises at the caller: new batches are kept
in memory, bounded by `memory_limit` records and `max_bytes` bytes of payload (oldest dropped
first), delivered batches whose file cannot be removed are forgotten (a restart may re-send
them; record ids dedupe), and `problem` says what is wrong until a write succeeds again.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gpuid_agent.delivery.backlog import BacklogFiles, NewerBatches
from gpuid_agent.delivery.exporters.base import BatchMeta, StoredForm
from gpuid_agent.delivery.spool_files import REJECTED_DIR, Encoded, SpoolFiles
from gpuid_agent.delivery.store import (
    JSON_LINES,
    BatchStore,
    MemoryBatches,
    StoredBatch,
    trim_memory,
)
from gpuid_agent.records.serialize import json_lines
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import formats, log
from gpuid_agent.runtime.errors import CorruptBatchError

__all__ = ["REJECTED_DIR", "BatchStore", "DiskSpool", "MemoryBatches", "StoredBatch"]

_log = log.get("spool")


def _consume_exception(task: asyncio.Future[Any]) -> None:
    # A prefetch whose batch was dropped is never awaited: read its outcome so asyncio
    # does not report it; the real load reads the file again and reports any error.
    if not task.cancelled():
        task.exception()


class DiskSpool(BatchStore):
    """Durable spool in `directory`, bounded by `max_bytes` (pending plus rejected files)."""

    durable = True

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        memory_limit: int = 10_000,
        form: StoredForm | None = None,
    ) -> None:
        super().__init__()
        self.form = form
        self.directory = directory
        self._files = SpoolFiles(directory)  # creates `rejected/` and proves it writable
        self.rejected_dir = self._files.rejected
        self.max_bytes = max_bytes
        self.memory_limit = max(1, memory_limit)  # records held in memory while unwritable
        self._rejected: OrderedDict[str, StoredBatch] = OrderedDict()
        self._bytes = 0
        self._problem: str | None = None
        self._orphans: list[Path] = []  # delivered or dropped, but their file would not go
        # read-ahead of at most the batch being sent and the one after it, by batch id
        self._prefetched: dict[str, asyncio.Task[list[AnyRecord]]] = {}
        self._unlinking: asyncio.Future[None] | None = None
        # read-ahead of the next joined delivery: its batch ids and the read (files, or records)
        self._ahead: tuple[tuple[str, ...], asyncio.Future[Any]] | None = None
        self.newer = NewerBatches()
        self._scan()

    def _scan(self) -> None:
        # names and sizes; batches a window at a time (odd entries go to `rejected/` first)
        backlog = BacklogFiles(self.directory, self._files.set_aside_odd)
        self._pending.feed(backlog, backlog.batches, backlog.records)
        self._bytes += backlog.bytes
        self.newer = backlog.newer
        if self.newer.batches:
            _log.warning(
                "spool holds batches of a newer format; kept for the version that wrote them",
                extra={
                    "spool": str(self.directory),
                    "batches": self.newer.batches,
                    "records": self.newer.records,
                    "format": self.newer.format,
                    "reads_up_to": formats.FORMATS[formats.SPOOL_BATCH],
                },
            )
        for batch in self._files.index_rejected():
            self._rejected[batch.meta.batch_id] = batch
            self._bytes += batch.size
        if self._pending:
            _log.info(
                "spool holds batches from a previous run; re-sending them",
                extra={
                    "spool": str(self.directory),
                    "batches": len(self._pending),
                    "records": self.records,
                    "bytes": self._bytes,
                },
            )

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def rejected_batches(self) -> int:
        return len(self._rejected)

    @property
    def newer_batches(self) -> int:
        return self.newer.batches

    @property
    def problem(self) -> str | None:
        return self._problem

    def describe(self) -> str:
        return str(self.directory)

    def full(self, records: int) -> bool:
        if not self._pending:
            return False
        if self._problem is not None:
            return self.memory_records + records > self.memory_limit
        return self._bytes >= self.max_bytes

    def _failed(self, exc: OSError, what: str) -> None:
        why = self._files.reason(exc)
        if self._problem != why:
            _log.error(
                f"spool {what} failed",
                extra={"spool": str(self.directory), "error": why},
            )
        self._problem = why

    async def _recovered(self) -> None:
        """A write went through: remove the files that would not go while it failed."""
        orphans, self._orphans = self._orphans, []
        for path in orphans:
            try:
                await asyncio.to_thread(path.unlink, missing_ok=True)
            except OSError:
                self._orphans.append(path)
        if self._problem is not None and not self._orphans:
            _log.info("spool writable again", extra={"spool": str(self.directory)})
            self._problem = None

    async def add(self, records: list[AnyRecord]) -> list[StoredBatch]:
        batch = StoredBatch(BatchMeta.new(), len(records))
        try:
            name = await asyncio.to_thread(self._encode_write, batch, records)
        except OSError as exc:
            batch.form = JSON_LINES
            self._failed(exc, "write")
            batch.records = records  # kept in memory, within the memory bound
            self._pending.add(batch)
            return trim_memory(
                self._pending, batch, self.memory_limit, self.max_bytes, "spool_unwritable"
            )
        batch.path = self.directory / name
        self._bytes += batch.size
        self._pending.add(batch)
        if self._problem is not None or self._orphans:
            await self._recovered()
        return await self._trim(keep=batch)

    def _encode_write(self, batch: StoredBatch, records: list[AnyRecord]) -> str:
        """Encode (the exporter's form, else JSON lines) and write; the file's name."""
        payload: bytes | None = None
        if self.form is not None:
            try:
                payload = self.form.encode(records)
                batch.form = self.form.suffix
            except Exception as exc:  # the records themselves are never lost to an encoder
                _log.error(
                    "batch kept as JSON lines: its stored form failed",
                    extra={"spool": str(self.directory), "error": repr(exc)},
                )
        if payload is None:
            payload = json_lines(records)
        name = self._files.name(batch)
        batch.size = len(payload)
        try:
            self._files.write(name, payload)
        except OSError:
            batch.form = JSON_LINES  # kept in memory as records; size stays an estimate
            raise
        return name

    async def _trim(self, keep: StoredBatch) -> list[StoredBatch]:
        dropped: list[StoredBatch] = []
        while self._bytes > self.max_bytes:
            victim = next(iter(self._rejected.values()), None)
            if victim is not None:
                del self._rejected[victim.meta.batch_id]
            else:
                victim = next(
                    (
                        b
                        for b in self._pending.values()
                        if b is not keep and not b.in_flight and b.path is not None
                    ),
                    None,
                )
                if victim is None:
                    break  # only the newest (or in-flight) batch is left: keep it
                self._pending.pop(victim.meta.batch_id)
            victim.dropped_for = "spool_full"
            dropped.append(victim)
            await self._unlink(victim)
        return dropped

    async def _unlink(self, batch: StoredBatch) -> None:
        """Delete a batch's file; one that will not go is remembered and retried once the
        spool is writable again."""
        self._drop_prefetch(batch.meta.batch_id)
        if batch.path is None:
            return
        path, batch.path = batch.path, None
        self._bytes -= batch.size
        try:
            await asyncio.to_thread(path.unlink, missing_ok=True)
        except OSError as exc:
            self._failed(exc, "remove")
            self._orphans.append(path)

    def prefetch_stored(self, batches: Sequence[StoredBatch]) -> None:
        # A backlog of many small files drains at the sink's speed only if the next
        # delivery's files are read while the current one is in flight.
        key = tuple(b.meta.batch_id for b in batches)
        if not key or (self._ahead is not None and self._ahead[0] == key):
            return
        if all(b.records is None and b.path is not None for b in batches):
            read: Callable[[], list[Any]]
            if all(b.form == JSON_LINES for b in batches):
                read = partial(self._read_joined, list(batches))
            elif all(b.form != JSON_LINES for b in batches):
                read = partial(self._files.read, _stored_paths(batches))
            else:
                return
            task = asyncio.ensure_future(asyncio.to_thread(read))
            task.add_done_callback(_consume_exception)
            self._ahead = (key, task)

    def _taken_ahead(self, batches: Sequence[StoredBatch]) -> asyncio.Future[Any] | None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == tuple(b.meta.batch_id for b in batches):
            return ahead[1]
        return None

    async def load_stored(self, batches: Sequence[StoredBatch]) -> list[Encoded]:
        ahead = self._taken_ahead(batches)
        if ahead is not None:
            files: list[Encoded] = await ahead
            return files
        return await asyncio.to_thread(self._files.read, _stored_paths(batches))

    async def load_joined(self, batches: Sequence[StoredBatch]) -> list[AnyRecord]:
        if all(b.records is not None for b in batches):
            return [r for b in batches for r in b.records or []]
        ahead = self._taken_ahead(batches)
        if ahead is not None:
            records: list[AnyRecord] = await ahead
            return records
        return await asyncio.to_thread(self._read_joined, list(batches))

    def _read_joined(self, batches: list[StoredBatch]) -> list[AnyRecord]:
        """The records of JSON-lines batch files, in order (one worker-thread hop for all)."""
        records: list[AnyRecord] = []
        for batch in batches:
            if batch.path is None or batch.form != JSON_LINES:
                raise CorruptBatchError("batch is not a JSON-lines file")
            records += self._files.read_records(batch.path, batch.count)
        return records

    def prefetch_after(self, batch: StoredBatch) -> None:
        # A backlog drains at the sink's speed only if the next file is decoded while the
        # current batch is in flight, not after it.
        following = next(self.following(batch), None)
        keep = {batch.meta.batch_id, following.meta.batch_id if following else ""}
        for stale in [k for k in self._prefetched if k not in keep]:
            self._drop_prefetch(stale)
        if (
            following is None
            or following.records is not None
            or following.path is None
            or following.form != JSON_LINES
            or following.meta.batch_id in self._prefetched
        ):
            return
        task = asyncio.ensure_future(
            asyncio.to_thread(self._files.read_records, following.path, following.count)
        )
        task.add_done_callback(_consume_exception)
        self._prefetched[following.meta.batch_id] = task

    def _drop_prefetch(self, batch_id: str) -> None:
        task = self._prefetched.pop(batch_id, None)
        if task is not None:
            task.cancel()

    async def load(self, batch: StoredBatch) -> list[AnyRecord]:
        if batch.records is not None:
            return batch.records
        if batch.path is None:
            raise CorruptBatchError("batch file is gone")
        if batch.form != JSON_LINES:
            raise CorruptBatchError(f"{batch.path.name} holds {batch.form}, not records")
        task = self._prefetched.pop(batch.meta.batch_id, None)
        if task is not None:
            return await task
        return await asyncio.to_thread(self._files.read_records, batch.path, batch.count)

    async def remove(self, batch: StoredBatch) -> None:
        self.forget(batch)
        await self._unlink(batch)

    async def remove_all(self, batches: Sequence[StoredBatch]) -> None:
        """Forget delivered batches at once and unlink their files in one thread hop, while
        the next delivery runs (thousands of small files take longer to unlink than to send);
        a crash before the unlink re-sends them, which record ids dedupe."""
        paths: list[Path] = []
        for batch in batches:
            self.forget(batch)
            self._drop_prefetch(batch.meta.batch_id)
            if batch.path is not None:
                paths.append(batch.path)
                batch.path = None
                self._bytes -= batch.size
        self._unlinking = asyncio.ensure_future(self._unlink_after(self._unlinking, paths))

    async def _unlink_after(self, previous: asyncio.Future[None] | None, paths: list[Path]) -> None:
        if previous is not None:
            await previous  # one unlinking thread at a time, in delivery order
        stuck = await asyncio.to_thread(self._files.unlink_all, paths)
        if stuck:
            self._failed(stuck[0][1], "remove")
            self._orphans += [path for path, _ in stuck]

    async def settle(self) -> None:
        """Wait for the unlinks `remove_all` started."""
        while self._unlinking is not None:
            task = self._unlinking
            await task
            if self._unlinking is task:
                self._unlinking = None

    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        self.forget(batch)
        if batch.path is None:
            if batch.records is None:
                return False, []
            try:  # a batch that only ever lived in memory: write it now
                name = self._files.name(batch)
                payload = json_lines(batch.records)
                path = await asyncio.to_thread(self._files.write, name, payload, True)
            except OSError as exc:
                self._failed(exc, "write")
                return False, []
            batch.path, batch.size, batch.records = path, len(payload), None
            self._bytes += batch.size
        else:
            try:
                target = await asyncio.to_thread(self._files.move_to_rejected, batch.path)
            except OSError as exc:
                self._failed(exc, "set-aside")
                await self._unlink(batch)
                return False, []
            batch.path = target
        self._rejected[batch.meta.batch_id] = batch
        dropped = await self._trim(keep=batch)
        kept = batch.meta.batch_id in self._rejected
        return kept, [d for d in dropped if d is not batch]


def _stored_paths(batches: Sequence[StoredBatch]) -> list[Path]:
    paths: list[Path] = []
    for batch in batches:
        if batch.path is None or batch.form == JSON_LINES:
            raise CorruptBatchError("batch is not a file in a stored form")
        paths.append(batch.path)
    return paths
