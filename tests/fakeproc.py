"""A fake host /proc tree in a directory: `<root>/<pid>/cgroup` files as the kernel writes
them, in the layouts the kubelet's two cgroup drivers make under cgroup v1 and v2."""

from __future__ import annotations

import shutil
from pathlib import Path

V1_CONTROLLERS = ("cpu,cpuacct", "memory", "pids", "devices")


def systemd_path(pod_uid: str, container_id: str, qos: str = "burstable") -> str:
    """The systemd driver: slices named after the QoS class and the UID, "-" as "_"."""
    uid = pod_uid.replace("-", "_")
    if qos == "guaranteed":
        pod_slice = f"/kubepods.slice/kubepods-pod{uid}.slice"
    else:
        pod_slice = f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
    return f"{pod_slice}/cri-containerd-{container_id}.scope" if container_id else pod_slice


def cgroupfs_path(pod_uid: str, container_id: str, qos: str = "burstable") -> str:
    base = "/kubepods" if qos == "guaranteed" else f"/kubepods/{qos}"
    return f"{base}/pod{pod_uid}/{container_id}" if container_id else f"{base}/pod{pod_uid}"


def v2(path: str) -> str:
    return f"0::{path}\n"


def v1(path: str) -> str:
    lines = [f"{12 - i}:{c}:{path}" for i, c in enumerate(V1_CONTROLLERS)]
    return "\n".join([*lines, "1:name=systemd:/system.slice/containerd.service"]) + "\n"


class FakeProc:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add(self, pid: int, cgroup: str | bytes) -> None:
        d = self.root / str(pid)
        d.mkdir(exist_ok=True)
        data = cgroup.encode() if isinstance(cgroup, str) else cgroup
        (d / "cgroup").write_bytes(data)

    def remove(self, pid: int) -> None:
        """The process exited: its directory is gone."""
        shutil.rmtree(self.root / str(pid), ignore_errors=True)
