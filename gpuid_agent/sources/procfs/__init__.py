"""The host's /proc, read-only: which pod and container a host PID runs in."""

from gpuid_agent.sources.procfs.cgroup import (
    HOST_PROCESS,
    PID_GONE,
    UNKNOWN_CGROUP,
    UNREADABLE,
    CgroupOwner,
    parse_cgroup,
)
from gpuid_agent.sources.procfs.host import HostProc

__all__ = [
    "HOST_PROCESS",
    "PID_GONE",
    "UNKNOWN_CGROUP",
    "UNREADABLE",
    "CgroupOwner",
    "HostProc",
    "parse_cgroup",
]
