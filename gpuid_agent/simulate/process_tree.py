"""Processes on a simulated node: host PIDs on the GPUs its pods hold, a /proc tree in a
temporary directory whose cgroup files put each PID in its pod's container (systemd and
cgroupfs layouts, cgroup v1 and v2), and the pods' UIDs and container ids as the Kubernetes
API would give them. Besides the pods' own processes: a host process on the time-sliced GPU,
a PID that exits before its /proc entry is read, and a pod busy on a GPU nobody holds."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid as uuidlib
from collections.abc import Sequence
from types import MappingProxyType

from gpuid_agent.simulate.pods import KubeletPod
from gpuid_agent.simulate.profiles import SimGpu, SimProcess
from gpuid_agent.sources.kube.pods import PodMeta

GIB = 1024**3
_ROGUE = ("batch", "stray-job", "worker")  # runs on a GPU it never asked the kubelet for


def _uid(node: str, namespace: str, name: str) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{node}/{namespace}/{name}"))


def _cid(uid: str, container: str) -> str:
    return hashlib.sha256(f"{uid}/{container}".encode()).hexdigest()


def _cgroup(uid: str, cid: str, style: int) -> str:
    """One of four real layouts, chosen by `style`."""
    under = uid.replace("-", "_")
    if style % 2 == 0:  # systemd driver
        path = (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{under}.slice"
            f"/cri-containerd-{cid}.scope"
        )
    else:  # cgroupfs driver
        path = f"/kubepods/burstable/pod{uid}/{cid}"
    if style // 2 % 2 == 0:
        return f"0::{path}\n"
    return "".join(f"{n}:{c}:{path}\n" for n, c in ((4, "pids"), (3, "memory"), (2, "cpu")))


class StaticPods:
    """A PodDirectory over the simulated pods (never changes)."""

    def __init__(self, pods: Sequence[PodMeta]) -> None:
        self.changed = asyncio.Event()
        self._by_name = {(p.namespace, p.name): p for p in pods}
        self._by_uid = {p.uid: p for p in pods}

    def lookup(self, namespace: str, name: str) -> PodMeta | None:
        return self._by_name.get((namespace, name))

    def by_uid(self, uid: str) -> PodMeta | None:
        return self._by_uid.get(uid)

    @property
    def ready(self) -> bool:
        return True

    @property
    def revision(self) -> int:
        return 0


def plan_processes(
    node: str, gpus: Sequence[SimGpu], pods: Sequence[KubeletPod], proc_root: str
) -> StaticPods:
    """Give the pods' GPUs processes and write their /proc entries under `proc_root`."""
    by_uuid = {g.uuid: g for g in gpus}
    metas: list[PodMeta] = []
    pid = 41_000
    style = 0

    def spawn(gpu: SimGpu, memory: int, sm: int, cgroup: str | None) -> None:
        """A process on `gpu`; `cgroup` None: it exits before /proc is read."""
        nonlocal pid
        pid += 7
        gpu.processes.append(SimProcess(pid, memory, sm))
        if cgroup is not None:
            os.makedirs(os.path.join(proc_root, str(pid)), exist_ok=True)
            with open(os.path.join(proc_root, str(pid), "cgroup"), "w") as fh:
                fh.write(cgroup)

    def in_pod(gpu: SimGpu, uid: str, cid: str, memory: int, sm: int) -> None:
        nonlocal style
        style += 1
        spawn(gpu, memory, sm, _cgroup(uid, cid, style))

    held: set[str] = set()
    for p in [*pods, KubeletPod(_ROGUE[0], _ROGUE[1])]:
        uid = _uid(node, p.namespace, p.name)
        containers = {_cid(uid, c.name): c.name for c in p.containers} or {
            _cid(uid, _ROGUE[2]): _ROGUE[2]
        }
        metas.append(PodMeta(p.namespace, p.name, uid, containers=MappingProxyType(containers)))
        for c in p.containers:
            cid = _cid(uid, c.name)
            for _, ids in c.devices:
                for n, device in enumerate(ids):
                    gpu = by_uuid.get(device.split("::", 1)[0])
                    if gpu is None:
                        continue
                    held.add(gpu.uuid)
                    if p.name == "notebook":
                        continue  # allocated and idle
                    replica = int(device.split("::", 1)[1]) if "::" in device else n
                    in_pod(gpu, uid, cid, (6 + 4 * replica) * GIB, 12 + 9 * replica)
    shared = next((g for g in gpus if len(g.processes) > 1), None)
    if shared is not None:
        spawn(shared, GIB // 2, 3, "0::/system.slice/dcgm-hostengine.service\n")  # host
        spawn(shared, GIB // 4, 0, None)  # exited between NVML's list and the /proc read
    free = [g for g in gpus if g.uuid not in held and not g.mig]
    if free:
        rogue = metas[-1]
        in_pod(free[0], rogue.uid, next(iter(rogue.containers)), 9 * GIB, 64)
    for gpu in gpus:
        gpu.telemetry_from_processes = True
    return StaticPods(metas)
