"""The small state files the agent keeps under STATE_DIR (open allocations, GPU serials per
slot): read without trusting what sits at their paths, written so that a crash (SIGKILL, power
loss) leaves either the old file or the new one, never a torn one.

`StateDir.load` is the one way a state file is read. Something other than the agent may have
put anything at the path: a FIFO, a symlink (to /dev/zero, or out of STATE_DIR), a huge or
damaged file. Such a file is moved, never opened or followed, into `STATE_DIR/rejected/`
(renamed `<file>.<UTC time>.<reason>`), logged once, counted in
`gpuid_state_files_rejected_total{file, reason}`, and its reader starts from empty state, as
without a state file. The next save writes a regular file at the path again.

A state file of a newer format than this version reads (`runtime.formats`: a rollback found the
newer version's file) is neither read nor set aside: it stays where it is, byte for byte, and
`path` answers None for it so that no save overwrites it. The agent runs without that state,
reported once (the status board's `state:<file>` component, which logs the change, and
`gpuid_state_files_newer{file}`), and the newer version reads it when it starts again.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import NewerFormatError, RefusedFileError
from gpuid_agent.runtime.regular_file import NOT_REGULAR, SYMLINK, TOO_LARGE, read_regular_file
from gpuid_agent.runtime.status import StatusBoard

# A record as the exporters received it; state files keep those they owe (and open allocations'
# starts) in that form, so a restarted agent sends them again with the same ids.
WireRecord = dict[str, Any]
T = TypeVar("T")

# Open allocations of a node with MIG on every GPU and the records they owe take tens of KiB.
MAX_STATE_FILE_BYTES = 4 * 1024 * 1024
REJECTED_DIR = "rejected"
UNREADABLE, INVALID = "unreadable", "invalid"
REJECT_REASONS = (SYMLINK, NOT_REGULAR, TOO_LARGE, UNREADABLE, INVALID)
# what a reader's `parse` raises for content that is no state it can use
# (orjson.JSONDecodeError is a ValueError)
PARSE_ERRORS = (ValueError, KeyError, TypeError, AttributeError)

_log = log.get("state")


class StateDir:
    """STATE_DIR, or no directory at all (`directory` empty: state lives as long as the
    process). `rejected` counts the files set aside, by file and reason; `newer` (1 or 0, by
    file) and `board` report the files kept for a newer version."""

    def __init__(
        self,
        directory: str,
        rejected: Counter | None = None,
        *,
        newer: Gauge | None = None,
        board: StatusBoard | None = None,
    ) -> None:
        self.directory = Path(directory) if directory else None
        self._rejected = rejected
        self._newer = newer
        self._board = board
        self.kept_newer: dict[str, int] = {}  # file → the format it is in

    def path(self, name: str) -> Path | None:
        """Where the state file `name` is written: None without STATE_DIR, or while the file
        there is of a newer format (kept for the version that wrote it)."""
        if self.directory is None or name in self.kept_newer:
            return None
        return self.directory / name

    def load(self, name: str, parse: Callable[[bytes], T]) -> T | None:
        """The state file `name` as `parse` makes it; None when there is none, or when it was
        set aside: not a regular file, over MAX_STATE_FILE_BYTES, unreadable, or content that
        `parse` refuses (it raises one of PARSE_ERRORS)."""
        path = self.path(name)
        if path is None:
            return None
        if self._rejected is not None:
            for reason in REJECT_REASONS:  # at 0 from the start, for alerts on the first
                self._rejected.labels(name, reason)
        if self._newer is not None:
            self._newer.labels(name).set(0)
        try:
            data = read_regular_file(path, MAX_STATE_FILE_BYTES)
        except FileNotFoundError:
            return None
        except RefusedFileError as exc:
            self._set_aside(path, exc.reason, str(exc))
            return None
        except OSError as exc:
            self._set_aside(path, UNREADABLE, str(exc))
            return None
        try:
            return parse(data)
        except NewerFormatError as exc:
            self._keep_newer(name, exc)
            return None
        except PARSE_ERRORS as exc:
            self._set_aside(path, INVALID, str(exc) or type(exc).__name__)
            return None

    def _keep_newer(self, name: str, exc: NewerFormatError) -> None:
        self.kept_newer[name] = exc.found
        if self._newer is not None:
            self._newer.labels(name).set(1)
        reason = (
            f"format {exc.found}, newer than this version reads (up to {exc.known}): kept in "
            "place for the version that wrote it, neither read nor written; running without it"
        )
        if self._board is not None:
            self._board.set(f"state:{name}", "degraded", reason)  # logged once, on /status
        else:
            _log.warning("state file kept: " + reason, extra={"file": name})

    def _set_aside(self, path: Path, reason: str, error: str) -> None:
        extra: dict[str, str] = {"file": path.name, "reason": reason, "error": error}
        try:
            extra["moved_to"] = str(_move_to_rejected(path, reason))
        except OSError as exc:  # the next save replaces it at the path all the same
            extra["move_error"] = str(exc)
        _log.warning("state file set aside; starting without it", extra=extra)
        if self._rejected is not None:
            self._rejected.labels(path.name, reason).inc()


def _move_to_rejected(path: Path, reason: str) -> Path:
    """Rename whatever is at `path` (never opened: a FIFO or a device is moved all the same,
    a symlink is moved, not its target) into `rejected/` beside it."""
    rejected = path.parent / REJECTED_DIR
    rejected.mkdir(exist_ok=True)
    if not stat.S_ISDIR(os.lstat(rejected).st_mode):  # a symlink would lead out of STATE_DIR
        raise NotADirectoryError(f"{rejected} is not a directory")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = rejected / f"{path.name}.{stamp}.{reason}"
    os.rename(path, target)
    return target


def write_atomically(path: Path, payload: bytes) -> None:
    """Write `payload` to a temporary file beside `path`, fsync it, and rename it over
    `path` (a rename within one directory is atomic; it replaces a symlink, not its target)."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
