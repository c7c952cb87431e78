"""Reads `<HOST_PROC>/<pid>/cgroup` for the PIDs NVML reports (host PIDs: the agent needs the
host's /proc mounted read-only, not hostPID). Blocking file reads: call from a worker thread."""

from __future__ import annotations

import os
from collections.abc import Iterable

from gpuid_agent.sources.procfs.cgroup import PID_GONE, UNREADABLE, CgroupOwner, parse_cgroup

_MAX_BYTES = 64 * 1024  # a cgroup file is a few hundred bytes; bound a hostile one


class HostProc:
    def __init__(self, root: str = "/proc") -> None:
        self.root = root

    def owner(self, pid: int) -> CgroupOwner | str:
        """The pod and container of `pid`, or the reason there is none."""
        if pid <= 0:
            return PID_GONE
        path = os.path.join(self.root, str(pid), "cgroup")
        try:
            with open(path, "rb") as fh:
                raw = fh.read(_MAX_BYTES)
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return PID_GONE
        except OSError:
            return UNREADABLE
        if not raw:  # a zombie's cgroup file reads empty
            return PID_GONE
        return parse_cgroup(raw.decode("utf-8", "replace"))

    def owners(self, pids: Iterable[int]) -> dict[int, CgroupOwner | str]:
        return {pid: self.owner(pid) for pid in set(pids)}
