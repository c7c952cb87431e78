"""Give the calling thread its name at the OS level too, so `top -H`, `ps -L` and
/proc/<pid>/task/*/comm tell the agent's threads apart (Python keeps names to itself)."""

from __future__ import annotations

import ctypes
import sys

_PR_SET_NAME = 15
_MAX_BYTES = 15  # the kernel keeps 16 bytes with the terminating NUL


def name_os_thread(name: str) -> None:
    """Best effort: a platform without prctl keeps the process's name for the thread."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_MAX_BYTES], 0, 0, 0)
    except (OSError, AttributeError):
        return
