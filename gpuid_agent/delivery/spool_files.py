"""One spool directory's files: their names, the index of what a previous run left, atomic
writes, reads, moves to `rejected/` and unlinks. All of it is blocking file I/O: the disk
spool runs these methods in worker threads (only the index, at start, runs inline).

Each file is named `<created ns>-<batch id>-<record count>.<form>`, so a spool can be indexed,
ordered and trimmed without reading a byte of it; from format 2 on (`runtime.formats`) the
format goes before the form, `….v<N>.<form>`, so a batch of a newer format than this version
reads is known by its name and left alone (`BacklogFiles.newer`). An entry under a batch's
name that no batch file can be (a FIFO, a symlink, a device, a file over
MAX_BATCH_FILE_BYTES) is moved into `rejected/` unopened when indexed; one swapped in later
fails its read (never blocking, never followed: `runtime/regular_file.py`) and its batch is set
aside.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from datetime import UTC, datetime
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.store import StoredBatch
from gpuid_agent.records.serialize import from_json_lines
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import formats, log
from gpuid_agent.runtime.errors import CorruptBatchError, RefusedFileError, WireError
from gpuid_agent.runtime.regular_file import read_regular_file

REJECTED_DIR = "rejected"
# Twice the largest batch the agent writes (BATCH_SIZE's bound, 100,000 records of ~600 bytes)
MAX_BATCH_FILE_BYTES = 128 * 1024 * 1024
# created ns, batch id, record count, format (none: 1), form
_NAME = re.compile(r"^(\d{1,20})-([0-9a-f]{32})-(\d{1,9})(?:\.v(\d{1,4}))?\.([a-z0-9]{1,16})$")
Encoded = bytes  # a batch file's content (`bytes` is a property name inside DiskSpool)
_log = log.get("spool")


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
        marker = formats.spool_marker(formats.FORMATS[formats.SPOOL_BATCH])
        return f"{created_ns:020d}-{batch.meta.batch_id}-{batch.count}{marker}.{batch.form}"

    def reason(self, exc: OSError) -> str:
        """What went wrong, for `problem` and logs."""
        detail = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
        return f"spool {self.directory}: {detail}"

    def index_rejected(self) -> list[StoredBatch]:
        """The batches whose files are in `rejected/`, oldest first; hidden temporary files of
        writes interrupted before their rename are removed. (The spool's own directory is read
        a window at a time: `backlog.BacklogFiles`.)"""
        found: list[StoredBatch] = []
        for entry in sorted(self.rejected.iterdir()):
            if entry.name.endswith(".tmp") and entry.name.startswith("."):
                with contextlib.suppress(OSError):  # a directory so named stays, ignored
                    entry.unlink(missing_ok=True)
                continue
            match = _NAME.match(entry.name)
            if not match or _newer(match):
                continue  # a newer version's rejected batch is its to keep or remove
            info = entry.lstat()  # a symlink is a batch's entry, never followed
            if stat.S_ISDIR(info.st_mode):
                continue
            created = datetime.fromtimestamp(int(match.group(1)) / 1e9, UTC)
            meta = BatchMeta(match.group(2), created)
            size = info.st_size
            batch = StoredBatch(meta, int(match.group(3)), size=size, path=entry)
            batch.form = match.group(5)
            found.append(batch)
        return found

    def set_aside_odd(self, entry: Path, exc: RefusedFileError) -> None:
        """Move an entry no batch file can be (a FIFO, a symlink, a device, a file over the
        bound) into `rejected/` unopened, where the spool's bound removes it first (it is
        indexed with `rejected/` next)."""
        extra = {"spool": str(self.directory), "file": entry.name, "error": str(exc)}
        try:
            self.move_to_rejected(entry)
        except OSError as move:
            extra["move_error"] = str(move)
        _log.error("spool file is no batch file; set aside", extra=extra)

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
        return [_read_batch_file(path) for path in paths]

    @staticmethod
    def read_records(path: Path, count: int) -> list[AnyRecord]:
        """Read and decode one JSON-lines batch file (in a worker thread: a 10,000-record
        batch takes tens of milliseconds to decode, which would stall scrapes on the loop)."""
        data = _read_batch_file(path)
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


def _read_batch_file(path: Path) -> Encoded:
    """A batch file's bytes; CorruptBatchError (the batch is set aside) when it cannot be read
    or is no regular file within MAX_BATCH_FILE_BYTES (swapped after the index)."""
    try:
        return read_regular_file(path, MAX_BATCH_FILE_BYTES)
    except (OSError, RefusedFileError) as exc:
        raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc


def _newer(match: re.Match[str]) -> bool:
    return formats.judge(formats.SPOOL_BATCH, int(match.group(4) or 1)) == "newer"


def batch_named(directory: Path, name: str, size: int) -> StoredBatch | None:
    """The batch a spool file's name describes (None for a name that is not a batch's)."""
    match = _NAME.match(name)
    if not match:
        return None
    created = datetime.fromtimestamp(int(match.group(1)) / 1e9, UTC)
    batch = StoredBatch(BatchMeta(match.group(2), created), int(match.group(3)), size=size)
    batch.path, batch.form = directory / name, match.group(5)
    return batch


def names_count(name: str) -> int:
    """The record count in a batch file's name (-1 for a name that is not a batch's)."""
    match = _NAME.match(name)
    return int(match.group(3)) if match else -1


def names_format(name: str) -> int:
    """The format of a batch file, from its name (1 without a `.v<N>`; the name must be a
    batch's: `names_count` is not -1)."""
    match = _NAME.match(name)
    return int(match.group(4) or 1) if match else 1
