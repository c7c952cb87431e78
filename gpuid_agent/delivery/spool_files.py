"""One spool directory's files: their names, the index of what a previous run left, atomic
writes, reads, moves to `rejected/` and unlinks. All of it is blocking file I/O: the disk
spool runs these methods in worker threads (only the index, at start, runs inline).

Each file is named `<created ns>-<batch id>-<record count>.<form>`, so a spool can be indexed,
ordered and trimmed without reading a byte of it.
"""

from __future__ import annotations

import contextlib
import os
import re
from datetime import UTC, datetime
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.store import StoredBatch
from gpuid_agent.records.serialize import from_json_lines
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import CorruptBatchError, WireError

REJECTED_DIR = "rejected"
_NAME = re.compile(r"^(\d{1,20})-([0-9a-f]{32})-(\d{1,9})\.([a-z0-9]{1,16})$")
Encoded = bytes  # a batch file's content (`bytes` is a property name inside DiskSpool)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rejected = directory / REJECTED_DIR
        self.rejected.mkdir(parents=True, exist_ok=True)
        probe = directory / ".probe.tmp"
        probe.write_bytes(b"")  # fail now, with the path in the error, if it is not writable
        probe.unlink()

    @staticmethod
    def name(batch: StoredBatch) -> str:
        created_ns = int(batch.meta.created.timestamp() * 1e9)
        return f"{created_ns:020d}-{batch.meta.batch_id}-{batch.count}.{batch.form}"

    def reason(self, exc: OSError) -> str:
        """What went wrong, for `problem` and logs."""
        detail = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
        return f"spool {self.directory}: {detail}"

    def index(self, rejected: bool = False) -> list[StoredBatch]:
        """The batches whose files are in the spool (or in `rejected/`), oldest first;
        hidden temporary files of writes interrupted before their rename are removed."""
        found: list[StoredBatch] = []
        for entry in sorted((self.rejected if rejected else self.directory).iterdir()):
            if entry.name.endswith(".tmp") and entry.name.startswith("."):
                entry.unlink(missing_ok=True)
                continue
            match = _NAME.match(entry.name)
            if not match or not entry.is_file():
                continue
            created = datetime.fromtimestamp(int(match.group(1)) / 1e9, UTC)
            meta = BatchMeta(match.group(2), created)
            size = entry.stat().st_size
            batch = StoredBatch(meta, int(match.group(3)), size=size, path=entry)
            batch.form = match.group(4)
            found.append(batch)
        return found

    def write(self, name: str, payload: bytes, rejected: bool = False) -> Path:
        """Write `payload` to a hidden temporary name, fsync it, rename it into place and
        fsync the directory: a crash leaves the whole batch or nothing, and so does a
        failed write (it removes what it wrote)."""
        directory = self.rejected if rejected else self.directory
        tmp, final = directory / f".{name}.tmp", directory / name
        renamed = False
        try:
            with open(tmp, "wb") as fh:
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            renamed = True
            _fsync_dir(directory)
        except BaseException:
            # Leave nothing behind: the caller keeps the batch elsewhere, and a file it does
            # not track would be sent again by the next start.
            with contextlib.suppress(OSError):
                (final if renamed else tmp).unlink(missing_ok=True)
            raise
        return final

    def move_to_rejected(self, path: Path) -> Path:
        target = self.rejected / path.name
        os.replace(path, target)
        with contextlib.suppress(OSError):
            _fsync_dir(self.rejected)
        return target

    @staticmethod
    def read(paths: list[Path]) -> list[Encoded]:
        out: list[Encoded] = []
        for path in paths:
            try:
                out.append(path.read_bytes())
            except OSError as exc:
                raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc
        return out

    @staticmethod
    def read_records(path: Path, count: int) -> list[AnyRecord]:
        """Read and decode one JSON-lines batch file (in a worker thread: a 10,000-record
        batch takes tens of milliseconds to decode, which would stall scrapes on the loop)."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc
        try:
            records = from_json_lines(data)
        except WireError as exc:
            raise CorruptBatchError(f"{path.name}: {exc}") from exc
        if len(records) != count:
            raise CorruptBatchError(
                f"{path.name} holds {len(records)} records, its name says {count}"
            )
        return records

    @staticmethod
    def unlink_all(paths: list[Path]) -> list[tuple[Path, OSError]]:
        """Remove files; those that would not go, with why."""
        stuck: list[tuple[Path, OSError]] = []
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                stuck.append((path, exc))
        return stuck


def batch_named(directory: Path, name: str, size: int) -> StoredBatch | None:
    """The batch a spool file's name describes (None for a name that is not a batch's)."""
    match = _NAME.match(name)
    if not match:
        return None
    created = datetime.fromtimestamp(int(match.group(1)) / 1e9, UTC)
    batch = StoredBatch(BatchMeta(match.group(2), created), int(match.group(3)), size=size)
    batch.path, batch.form = directory / name, match.group(4)
    return batch


def names_count(name: str) -> int:
    """The record count in a batch file's name (-1 for a name that is not a batch's)."""
    match = _NAME.match(name)
    return int(match.group(3)) if match else -1
