"""The disk spool's file operations, run in worker threads: atomic writes, reads, unlinks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from gpuid_agent.delivery.exporters.base import Record
from gpuid_agent.delivery.store import JSON_LINES, StoredBatch, decode
from gpuid_agent.runtime.errors import CorruptBatchError


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, name: str, payload: bytes) -> None:
    tmp, final = directory / f".{name}.tmp", directory / name
    renamed = False
    try:
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        renamed = True
        fsync_dir(directory)
    except BaseException:
        # Leave nothing behind: the caller keeps the batch elsewhere, and a file it does
        # not track would be sent again by the next start.
        with contextlib.suppress(OSError):
            (final if renamed else tmp).unlink(missing_ok=True)
        raise


Encoded = bytes  # a batch file's content (`bytes` is a property name inside DiskSpool)


def read_files(paths: list[Path]) -> list[Encoded]:
    out: list[Encoded] = []
    for path in paths:
        try:
            out.append(path.read_bytes())
        except OSError as exc:
            raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc
    return out


def unlink_all(paths: list[Path]) -> list[tuple[Path, OSError]]:
    stuck: list[tuple[Path, OSError]] = []
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            stuck.append((path, exc))
    return stuck


def reason(directory: Path, exc: OSError) -> str:
    detail = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
    return f"spool {directory}: {detail}"


def read_records(path: Path, count: int) -> list[Record]:
    """Read and decode one batch file (in a worker thread: a 10,000-record batch takes
    tens of milliseconds to decode, which would stall scrapes on the event loop)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorruptBatchError(f"cannot read {path.name}: {exc}") from exc
    records = decode(data)
    if len(records) != count:
        raise CorruptBatchError(f"{path.name} holds {len(records)} records, its name says {count}")
    return records


def stored_paths(batches: Sequence[StoredBatch]) -> list[Path]:
    paths: list[Path] = []
    for batch in batches:
        if batch.path is None or batch.form == JSON_LINES:
            raise CorruptBatchError("batch is not a file in a stored form")
        paths.append(batch.path)
    return paths
