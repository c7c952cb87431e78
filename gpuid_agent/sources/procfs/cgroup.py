"""`/proc/<pid>/cgroup` text → the pod UID and container id the kubelet put the process under.

The kubelet names a pod's cgroup after its UID and the runtime names the container's after its
id, under either cgroup driver and either cgroup version:

    systemd:  /kubepods.slice/kubepods-burstable.slice/
              kubepods-burstable-pod<uid, "-" as "_">.slice/cri-containerd-<id>.scope
    cgroupfs: /kubepods/burstable/pod<uid>/<id>     (crio-/docker- prefixes seen too)

cgroup v2 has one line `0::<path>`; v1 has one line per hierarchy, and any hierarchy the
kubelet manages carries the same path. A reader in its own cgroup namespace sees paths such
as `/../../kubepods.slice/...`, so the pattern is searched, not anchored. Static pods' UIDs
are 32 hex digits without dashes. The pod's own cgroup without a container part (a process
the runtime placed directly in it) yields the pod with an empty container id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HOST_PROCESS = "host_process"  # not under kubepods: a host daemon or a non-Kubernetes container
UNKNOWN_CGROUP = "unknown_cgroup"  # under kubepods, in a layout the parser does not know
PID_GONE = "pid_gone"  # exited between NVML's list and the /proc read
UNREADABLE = "proc_unreadable"  # /proc/<pid>/cgroup exists but could not be read

_DASHED = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_UID = rf"(?P<uid>{_DASHED}|[0-9a-f]{{32}})"
_ID = r"(?P<cid>[0-9a-f]{64})"
_RUNTIME = r"(?:cri-containerd|containerd|docker|crio|cri-o)"
_QOS = r"(?P<qos>besteffort|burstable)"
_SYSTEMD = re.compile(rf"kubepods(?:-{_QOS})?-pod{_UID}\.slice(?:/{_RUNTIME}-{_ID}\.scope)?(?=/|$)")
_CGROUPFS = re.compile(rf"/kubepods(?:/{_QOS})?/pod{_UID}(?:/(?:{_RUNTIME}-)?{_ID})?(?=/|$)")
_MAX_LINE = 4096


@dataclass(frozen=True, slots=True)
class CgroupOwner:
    pod_uid: str  # lower case, with dashes (or 32 hex digits for a static pod)
    container_id: str  # 64 hex digits, "" for the pod's own cgroup
    qos: str  # guaranteed, burstable or besteffort


def _owner(match: re.Match[str]) -> CgroupOwner:
    return CgroupOwner(
        pod_uid=match["uid"].replace("_", "-"),
        container_id=match["cid"] or "",
        qos=match["qos"] or "guaranteed",
    )


def _path(line: str) -> str | None:
    # hierarchy-ID:controller-list:path; the path itself may contain ':'
    parts = line.split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit():
        return None
    return parts[2]


def parse_cgroup(text: str) -> CgroupOwner | str:
    """The pod and container a process's cgroup file names, or why not (HOST_PROCESS,
    UNKNOWN_CGROUP). Never raises: the text comes from the host and may be anything."""
    saw_kubepods = False
    found: CgroupOwner | None = None
    for raw in text.splitlines():
        path = _path(raw[:_MAX_LINE])
        if path is None or "kubepods" not in path:
            continue
        saw_kubepods = True
        path = path.strip().lower()
        match = _SYSTEMD.search(path) or _CGROUPFS.search(path)
        if match is None:
            continue
        owner = _owner(match)
        # v1 hierarchies repeat the path; one naming the container beats one naming the pod
        if found is None or (owner.container_id and not found.container_id):
            found = owner
        if found.container_id:
            break
    if found is not None:
        return found
    return UNKNOWN_CGROUP if saw_kubepods else HOST_PROCESS
