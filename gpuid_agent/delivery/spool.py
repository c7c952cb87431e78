"""Where an exporter's undelivered batches wait: in memory, or durably on disk (SPOOL_DIR).

The disk spool writes each batch to its own file before the first delivery attempt: written to
a hidden temporary name, fsync'd, renamed into place (atomic), and the directory fsync'd, so a
crash leaves either the whole batch or nothing. A delivered batch's file is removed; files
left behind by a previous run are re-sent, oldest first. Each file is named
`<created ns>-<batch id>-<record count>.ndjson`, so the spool can be indexed, ordered and
trimmed without reading a byte of it. Batches a sink rejected move to `rejected/` for an
operator to inspect or replay. Both stores are bounded and drop their oldest batches (rejected
ones first) when full; the caller counts and logs what was dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import orjson

from gpuid_agent.delivery.exporters.base import BatchMeta, Record, json_bytes
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError

_log = log.get("spool")
_NAME = re.compile(r"^(\d{1,20})-([0-9a-f]{32})-(\d{1,9})\.ndjson$")
REJECTED_DIR = "rejected"


@dataclass(slots=True, eq=False)
class StoredBatch:
    meta: BatchMeta
    count: int
    size: int = 0
    records: list[Record] | None = None  # in memory (memory store, or a failed disk write)
    path: Path | None = None
    in_flight: bool = False


class BatchStore(ABC):
    """Pending batches of one exporter, oldest first, within a size bound."""

    durable = False

    def __init__(self) -> None:
        self._pending: OrderedDict[str, StoredBatch] = OrderedDict()

    @abstractmethod
    async def add(self, records: list[Record]) -> list[StoredBatch]:
        """Store a new batch; return the batches dropped to stay within the bound."""

    @abstractmethod
    async def load(self, batch: StoredBatch) -> list[Record]: ...

    @abstractmethod
    async def remove(self, batch: StoredBatch) -> None: ...

    @abstractmethod
    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        """Move a rejected batch out of the way: (its records were kept, batches dropped
        to make room for it)."""

    def oldest(self) -> StoredBatch | None:
        return next(iter(self._pending.values()), None)

    def prefetch_after(self, batch: StoredBatch) -> None:
        """Start reading the batch queued after `batch` while `batch` is being sent."""
        return None

    @abstractmethod
    def full(self, records: int) -> bool:
        """Whether adding `records` more would pass the bound (never for an empty store)."""

    @property
    def batches(self) -> int:
        return len(self._pending)

    @property
    def records(self) -> int:
        return sum(b.count for b in self._pending.values())

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

    async def add(self, records: list[Record]) -> list[StoredBatch]:
        batch = StoredBatch(BatchMeta.new(), len(records), records=records)
        self._pending[batch.meta.batch_id] = batch
        dropped: list[StoredBatch] = []
        total = self.records
        for candidate in list(self._pending.values()):
            if total <= self.max_records:
                break
            if candidate is batch or candidate.in_flight:
                continue
            del self._pending[candidate.meta.batch_id]
            total -= candidate.count
            dropped.append(candidate)
        return dropped

    async def load(self, batch: StoredBatch) -> list[Record]:
        return batch.records or []

    async def remove(self, batch: StoredBatch) -> None:
        self._pending.pop(batch.meta.batch_id, None)

    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        self._pending.pop(batch.meta.batch_id, None)
        return False, []


def _encode(records: list[Record]) -> bytes:
    return b"".join(json_bytes(r) + b"\n" for r in records)


def _decode(data: bytes) -> list[Record]:
    # Fast path: JSON text never holds a raw newline, so the lines joined by commas are one
    # JSON array, parsed in one call.
    body = data.strip()
    try:
        whole = orjson.loads(b"[" + body.replace(b"\n", b",") + b"]") if body else []
    except orjson.JSONDecodeError:
        pass
    else:
        if all(isinstance(r, dict) for r in whole):
            return whole
    out: list[Record] = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            try:  # lines written through the ASCII-escape fallback
                value = json.loads(line)
            except ValueError as exc:
                raise CorruptBatchError(f"unreadable line: {exc}") from exc
        if not isinstance(value, dict):
            raise CorruptBatchError("a line is not a JSON object")
        out.append(value)
    return out


def _consume_exception(task: asyncio.Future[list[Record]]) -> None:
    # A prefetch whose batch was dropped is never awaited: read its outcome so asyncio
    # does not report it; the real load reads the file again and reports any error.
    if not task.cancelled():
        task.exception()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(directory: Path, name: str, payload: bytes) -> None:
    tmp = directory / f".{name}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / name)
    _fsync_dir(directory)


class DiskSpool(BatchStore):
    """Durable spool in `directory`, bounded by `max_bytes` (pending plus rejected files)."""

    durable = True

    def __init__(self, directory: Path, max_bytes: int) -> None:
        super().__init__()
        self.directory = directory
        self.rejected_dir = directory / REJECTED_DIR
        self.max_bytes = max_bytes
        self._rejected: OrderedDict[str, StoredBatch] = OrderedDict()
        self._bytes = 0
        self.write_error: str | None = None
        # read-ahead of at most the batch being sent and the one after it, by batch id
        self._prefetched: dict[str, asyncio.Task[list[Record]]] = {}
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        probe = directory / ".probe.tmp"
        probe.write_bytes(b"")  # fail now, with the path in the error, if it is not writable
        probe.unlink()
        self._scan()

    @staticmethod
    def _name(batch: StoredBatch) -> str:
        created_ns = int(batch.meta.created.timestamp() * 1e9)
        return f"{created_ns:020d}-{batch.meta.batch_id}-{batch.count}.ndjson"

    def _index(self, directory: Path) -> list[StoredBatch]:
        found: list[StoredBatch] = []
        for entry in sorted(directory.iterdir()):
            if entry.name.endswith(".tmp") and entry.name.startswith("."):
                entry.unlink(missing_ok=True)  # a write interrupted before its rename
                continue
            match = _NAME.match(entry.name)
            if not match or not entry.is_file():
                continue
            created = datetime.fromtimestamp(int(match.group(1)) / 1e9, UTC)
            meta = BatchMeta(match.group(2), created)
            size = entry.stat().st_size
            found.append(StoredBatch(meta, int(match.group(3)), size=size, path=entry))
        return found

    def _scan(self) -> None:
        for batch in self._index(self.directory):
            self._pending[batch.meta.batch_id] = batch
            self._bytes += batch.size
        for batch in self._index(self.rejected_dir):
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

    def describe(self) -> str:
        return str(self.directory)

    def full(self, records: int) -> bool:
        return bool(self._pending) and self._bytes >= self.max_bytes

    async def add(self, records: list[Record]) -> list[StoredBatch]:
        batch = StoredBatch(BatchMeta.new(), len(records))
        payload = _encode(records)
        name = self._name(batch)
        try:
            await asyncio.to_thread(_write_atomic, self.directory, name, payload)
        except OSError as exc:
            # Disk full or failing: keep the batch in memory rather than lose it.
            if self.write_error is None:
                _log.error(
                    "spool write failed; keeping batches in memory",
                    extra={"spool": str(self.directory), "error": str(exc)},
                )
            self.write_error = str(exc)
            batch.records = records
        else:
            if self.write_error is not None:
                _log.info("spool writable again", extra={"spool": str(self.directory)})
            self.write_error = None
            batch.path = self.directory / name
            batch.size = len(payload)
            self._bytes += batch.size
        self._pending[batch.meta.batch_id] = batch
        return await self._trim(keep=batch)

    async def _trim(self, keep: StoredBatch) -> list[StoredBatch]:
        dropped: list[StoredBatch] = []
        while self._bytes > self.max_bytes:
            victim = next(iter(self._rejected.values()), None)
            if victim is not None:
                del self._rejected[victim.meta.batch_id]
                dropped.append(victim)
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
                del self._pending[victim.meta.batch_id]
                dropped.append(victim)
            await self._unlink(victim)
        return dropped

    async def _unlink(self, batch: StoredBatch) -> None:
        self._drop_prefetch(batch.meta.batch_id)
        if batch.path is not None:
            path = batch.path
            await asyncio.to_thread(path.unlink, missing_ok=True)
            self._bytes -= batch.size
            batch.path = None

    @staticmethod
    def _read(path: Path, count: int) -> list[Record]:
        """Read and decode one batch file (in a worker thread: a 10,000-record batch takes
        tens of milliseconds to decode, which would stall scrapes on the event loop)."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc
        records = _decode(data)
        if len(records) != count:
            raise CorruptBatchError(
                f"{path.name} holds {len(records)} records, its name says {count}"
            )
        return records

    def prefetch_after(self, batch: StoredBatch) -> None:
        # A backlog drains at the sink's speed only if the next file is decoded while the
        # current batch is in flight, not after it.
        ids = iter(self._pending)
        for batch_id in ids:
            if batch_id == batch.meta.batch_id:
                break
        following = self._pending.get(next(ids, ""))
        keep = {batch.meta.batch_id, following.meta.batch_id if following else ""}
        for stale in [k for k in self._prefetched if k not in keep]:
            self._drop_prefetch(stale)
        if (
            following is None
            or following.records is not None
            or following.path is None
            or following.meta.batch_id in self._prefetched
        ):
            return
        task = asyncio.ensure_future(asyncio.to_thread(self._read, following.path, following.count))
        task.add_done_callback(_consume_exception)
        self._prefetched[following.meta.batch_id] = task

    def _drop_prefetch(self, batch_id: str) -> None:
        task = self._prefetched.pop(batch_id, None)
        if task is not None:
            task.cancel()

    async def load(self, batch: StoredBatch) -> list[Record]:
        if batch.records is not None:
            return batch.records
        if batch.path is None:
            raise CorruptBatchError("batch file is gone")
        task = self._prefetched.pop(batch.meta.batch_id, None)
        if task is not None:
            return await task
        return await asyncio.to_thread(self._read, batch.path, batch.count)

    async def remove(self, batch: StoredBatch) -> None:
        self._pending.pop(batch.meta.batch_id, None)
        await self._unlink(batch)

    async def set_aside(self, batch: StoredBatch) -> tuple[bool, list[StoredBatch]]:
        self._pending.pop(batch.meta.batch_id, None)
        if batch.path is None:
            if batch.records is None:
                return False, []
            try:  # a batch that only ever lived in memory: write it now
                name = self._name(batch)
                payload = _encode(batch.records)
                await asyncio.to_thread(_write_atomic, self.rejected_dir, name, payload)
            except OSError:
                return False, []
            batch.path, batch.size, batch.records = self.rejected_dir / name, len(payload), None
            self._bytes += batch.size
        else:
            target = self.rejected_dir / batch.path.name
            try:
                await asyncio.to_thread(os.replace, batch.path, target)
            except OSError:
                await self._unlink(batch)
                return False, []
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_fsync_dir, self.rejected_dir)
            batch.path = target
        self._rejected[batch.meta.batch_id] = batch
        dropped = await self._trim(keep=batch)
        kept = batch.meta.batch_id in self._rejected
        return kept, [d for d in dropped if d is not batch]
