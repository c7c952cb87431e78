"""The one way the agent reads a file that something else may have put at its path (a state
file under STATE_DIR, a spooled batch): a regular file, never a symlink, of bounded size.

A FIFO would block the opening thread until a writer comes, a symlink to /dev/zero would be
read until memory runs out, and a symlink may point outside the directory the agent owns. So
the path is checked with `lstat` before it is opened (a FIFO or a device is never opened),
opened with O_NOFOLLOW and O_NONBLOCK (what was swapped in between neither blocks nor is
followed), checked again on the open descriptor, and read to at most `limit` + 1 bytes.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gpuid_agent.runtime.errors import RefusedFileError

# `RefusedFileError.reason`s
SYMLINK = "symlink"
NOT_REGULAR = "not_regular"
TOO_LARGE = "too_large"
_CHUNK = 1024 * 1024


def check_regular(mode: int, size: int, limit: int, name: str) -> None:
    """Raise RefusedFileError unless `mode` is a regular file's and `size` within `limit`."""
    if stat.S_ISLNK(mode):
        raise RefusedFileError(SYMLINK, f"{name} is a symlink")
    if not stat.S_ISREG(mode):
        raise RefusedFileError(NOT_REGULAR, f"{name} is not a regular file ({_kind(mode)})")
    if size > limit:
        raise RefusedFileError(TOO_LARGE, f"{name} holds {size} bytes, over {limit}")


def read_regular_file(path: Path, limit: int) -> bytes:
    """The whole content of the regular file at `path`, of at most `limit` bytes.

    Raises FileNotFoundError when nothing is there, RefusedFileError when what is there is
    not a regular file within `limit` (never blocking, never following a symlink, never
    reading more than `limit` + 1 bytes), and OSError when it cannot be read."""
    found = os.lstat(path)
    check_regular(found.st_mode, found.st_size, limit, path.name)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # became a symlink since the lstat
            raise RefusedFileError(SYMLINK, f"{path.name} is a symlink") from exc
        raise
    try:
        info = os.fstat(fd)
        check_regular(info.st_mode, info.st_size, limit, path.name)
        chunks: list[bytes] = []
        left = limit + 1  # one byte more than allowed tells a file that grew past the bound
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise RefusedFileError(TOO_LARGE, f"{path.name} grew over {limit} bytes while read")
    return data


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return kind
    return f"mode {stat.S_IFMT(mode):o}"
