"""NVML's processes and the host's cgroups mapped to holders: per-process shares of each device.

Pure over its inputs: the processes NVML listed per GPU, the cgroup owner (or the reason there
is none) of each PID, the kubelet attribution and a pod lookup by UID. A PID's cgroup names
its pod UID and container id; the pod cache turns these into namespace, pod and container
name. The pod's own Holder from the kubelet attribution is reused where it exists, so labels
and workload agree with `gpuid_gpu_allocation_info`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.nvml.process_values import GpuProcesses, ProcessInfo
from gpuid_agent.sources.procfs import CgroupOwner
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.attribution.mapping import make_holder
from gpuid_agent.state.attribution.shares import (
    UNACCOUNTED,
    UNKNOWN_POD,
    DeviceShares,
    ProcessUse,
    ProcessView,
    Share,
)

UidLookup = Callable[[str], PodMeta | None]
_Key = tuple[str, str, str]


class _Holders:
    """Pod UID and container id → Holder, reusing the kubelet attribution's holders."""

    def __init__(
        self, attribution: Attribution, by_uid: UidLookup | None, allowlist: Sequence[str]
    ) -> None:
        self._by_uid = by_uid
        self._allowlist = allowlist
        self._known: dict[_Key, Holder] = {}
        self._pod_containers: dict[str, list[Holder]] = {}
        for a in attribution.allocations:
            h = a.holder
            self._known.setdefault((h.namespace, h.pod, h.container), h)
            if h.pod_uid:
                self._pod_containers.setdefault(h.pod_uid, []).append(h)

    def holder(self, owner: CgroupOwner) -> Holder | None:
        meta = self._by_uid(owner.pod_uid) if self._by_uid is not None else None
        gpu_holders = self._pod_containers.get(owner.pod_uid, [])
        if meta is None:
            if not gpu_holders:
                return None
            namespace, pod = gpu_holders[0].namespace, gpu_holders[0].pod
        else:
            namespace, pod = meta.namespace, meta.name
        container = meta.containers.get(owner.container_id, "") if meta is not None else ""
        if not container and len({h.container for h in gpu_holders}) == 1:
            container = gpu_holders[0].container  # the pod's one GPU container
        key = (namespace, pod, container)
        found = self._known.get(key)
        if found is None:
            found = self._known[key] = make_holder(*key, meta, self._allowlist)
        return found


def _device(gpu: GpuIdentity, proc: ProcessInfo) -> str:
    """The GPU or MIG device a process runs on (its GPU instance on a MIG GPU)."""
    if proc.gpu_instance_id is None or not gpu.mig_devices:
        return gpu.uuid
    for mig in gpu.mig_devices:
        if mig.gpu_instance_id == proc.gpu_instance_id and proc.compute_instance_id in (
            None,
            mig.compute_instance_id,
        ):
            return mig.uuid
    return gpu.uuid


def share_processes(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    attribution: Attribution,
    readings: Mapping[str, GpuProcesses],
    owners: Mapping[int, CgroupOwner | str],
    *,
    by_uid: UidLookup | None = None,
    label_allowlist: Sequence[str] = (),
) -> ProcessView:
    holders = _Holders(attribution, by_uid, label_allowlist)
    uses: dict[str, list[ProcessUse]] = {}
    for gpu in inventory.gpus:
        uses[gpu.uuid] = []
        for mig in gpu.mig_devices:
            uses[mig.uuid] = []
        reading = readings.get(gpu.uuid)
        if reading is None or reading.failed:
            continue
        for proc in reading.processes:
            device = _device(gpu, proc)
            owner = owners.get(proc.pid, UNKNOWN_POD)
            holder = holders.holder(owner) if isinstance(owner, CgroupOwner) else None
            reason = "" if holder is not None else owner if isinstance(owner, str) else UNKNOWN_POD
            sm = None if reading.sm_util is None else reading.sm_util.get(proc.pid, 0.0)
            uses[device].append(
                ProcessUse(
                    pid=proc.pid,
                    holder=holder,
                    reason=reason,
                    memory_bytes=proc.used_memory,
                    sm_util=sm,
                    allocated=holder is not None and holder in attribution.holders(device),
                )
            )
    # A MIG GPU's own figures cover its MIG devices: its shares get no remainder of them.
    parents = {gpu.uuid for gpu in inventory.gpus if gpu.mig_devices}
    devices = {
        uuid: _shares(
            uuid,
            tuple(sorted(found, key=lambda u: u.pid)),
            None if uuid in parents else samples.get(uuid),
        )
        for uuid, found in uses.items()
    }
    return ProcessView("current", MappingProxyType(devices))


def _shares(uuid: str, uses: tuple[ProcessUse, ...], sample: GpuSample | None) -> DeviceShares:
    groups: dict[object, list[ProcessUse]] = {}
    for use in uses:
        groups.setdefault(use.holder if use.holder is not None else use.reason, []).append(use)
    values = sample.values if sample is not None else {}
    memory, mem_scaled = _split(
        [[u.memory_bytes for u in g] for g in groups.values()], values.get("memory_used_bytes")
    )
    # Without per-process samples the device's utilization is not split at all.
    sampled = not uses or any(u.sm_util is not None for u in uses)
    sm, sm_scaled = _split(
        [[u.sm_util for u in g] for g in groups.values()],
        values.get("gpu_util") if sampled else None,
    )
    shares = [
        Share(
            holder=g[0].holder,
            reason=g[0].reason,
            memory_bytes=memory[i],
            sm_util=sm[i],
            processes=len(g),
            allocated=g[0].allocated,
        )
        for i, g in enumerate(groups.values())
    ]
    shares.sort(key=_share_order)
    rest_memory, rest_sm = memory[len(groups)], sm[len(groups)]
    if rest_memory is not None or rest_sm is not None:
        shares.append(Share(None, UNACCOUNTED, rest_memory, rest_sm, 0))
    return DeviceShares(uuid, uses, tuple(shares), mem_scaled or sm_scaled)


def _share_order(s: Share) -> tuple[int, str, str, str, str]:
    if s.holder is None:
        return 1, s.reason, "", "", ""
    return 0, "", s.holder.namespace, s.holder.pod, s.holder.container


def _split(
    groups: list[list[float | int | None]], total: float | None
) -> tuple[list[float | None], bool]:
    """Each group's sum, scaled so that they never exceed `total`, and the remainder last
    (None without a total). A group whose every value is None stays None."""
    sums: list[float | None] = [
        None if all(v is None for v in g) else float(sum(v for v in g if v is not None))
        for g in groups
    ]
    if total is None:
        return [*sums, None], False
    known = sum(s for s in sums if s is not None)
    scaled = known > total
    if scaled:
        factor = total / known if known else 0.0
        sums = [None if s is None else s * factor for s in sums]
    rest = max(float(total) - sum(s for s in sums if s is not None), 0.0)
    return [*sums, rest], scaled
