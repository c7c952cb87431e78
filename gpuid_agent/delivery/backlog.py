"""A previous run's spool files, turned into batches a window at a time.

After a long outage a spool may hold 100,000 files. At start only their names and sizes are
read (names oldest first, sizes in an array: about 120 bytes a file); `Pending` takes batches
from here as its backlog lane drains, so memory follows the window, not the backlog.

Batches whose name says a newer format than this version reads (a rollback found the newer
version's backlog) are not taken: they stay in the directory, unopened, for that version to send
when it starts again, and only their count, records and format are kept (`newer`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuid_agent.delivery.pending import StoredBatch
from gpuid_agent.delivery.spool_files import (
    MAX_BATCH_FILE_BYTES,
    batch_named,
    names_count,
    names_format,
)
from gpuid_agent.runtime import formats
from gpuid_agent.runtime.errors import RefusedFileError
from gpuid_agent.runtime.regular_file import check_regular


class NewerBatches:
    """A newer version's batch files left in the spool: how many, their records, the newest
    format among them."""

    def __init__(self) -> None:
        self.batches = self.records = self.format = 0

    def note(self, name: str) -> bool:
        """Count `name` if it is a newer format's batch file (and say so)."""
        found = names_format(name)
        if formats.judge(formats.SPOOL_BATCH, found) != "newer":
            return False
        self.batches += 1
        self.records += names_count(name)
        self.format = max(self.format, found)
        return True


class BacklogFiles:
    """The batch files in `directory` (regular files with a batch's name), oldest first;
    hidden temporaries of writes interrupted before their rename are removed, and an entry
    under a batch's name that no batch file can be (a FIFO, a symlink, a device, a file over
    MAX_BATCH_FILE_BYTES) is handed to `set_aside` unopened."""

    def __init__(
        self, directory: Path, set_aside: Callable[[Path, RefusedFileError], None]
    ) -> None:
        self.directory = directory
        self.newer = NewerBatches()
        found: list[str] = []  # names only: a (name, size) pair a file would double the peak
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):  # a directory so named stays, ignored
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if names_count(entry.name) < 0 or self.newer.note(entry.name):
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISDIR(info.st_mode):
                        continue
                    check_regular(info.st_mode, info.st_size, MAX_BATCH_FILE_BYTES, entry.name)
                except FileNotFoundError:
                    continue  # gone since the listing
                except RefusedFileError as exc:
                    set_aside(Path(entry.path), exc)
                    continue
                found.append(entry.name)
        found.sort()
        self._names: deque[str] = deque()
        self._sizes = array("q")
        for name in found:
            try:
                size = os.stat(os.path.join(directory, name), follow_symlinks=False).st_size
            except OSError:
                continue  # gone since the listing
            self._names.append(name)
            self._sizes.append(size)
        del found
        self.batches = len(self._names)
        self.records = sum(names_count(name) for name in self._names)
        self.bytes = sum(self._sizes)

    def __iter__(self) -> Iterator[StoredBatch]:
        for size in self._sizes:
            batch = batch_named(self.directory, self._names.popleft(), size)
            if batch is not None:
                batch.backlog = True
                yield batch
        self._sizes = array("q")
