"""The small state files the agent keeps under STATE_DIR (open allocations, GPU serials per
slot), written so that a crash (SIGKILL, power loss) leaves either the old file or the new one,
never a torn one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

# A record as the exporters received it; state files keep those they owe (and open allocations'
# starts) in that form, so a restarted agent sends them again with the same ids.
WireRecord = dict[str, Any]


def write_atomically(path: Path, payload: bytes) -> None:
    """Write `payload` to a temporary file beside `path`, fsync it, and rename it over
    `path` (a rename within one directory is atomic)."""
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
