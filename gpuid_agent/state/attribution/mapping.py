"""Kubelet device ids mapped onto the NVML inventory: who holds which GPU.

Pure functions over snapshots. A GPU shared through time-slicing or MPS (`GPU-…::N`, GKE
`/vgpuN`) is held by every container that has one of its replicas; a MIG device is held by
the containers that have it, and its parent GPU is not itself held. Device ids that fit no
known form, or name a GPU this node does not have, are collected in `unmapped`, never fatal.
Devices of DRA claims are joined in `dra.py`; every container consuming a claim holds its
devices (a claim shared by two pods gives both the GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import MappingProxyType

from gpuid_agent.facts import NodeInventory
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.kubelet import (
    ClaimAssignment,
    DeviceAssignment,
    DeviceIdError,
    PodResourcesSnapshot,
    parse_device_id,
)
from gpuid_agent.state.attribution.device_index import DeviceIndex
from gpuid_agent.state.attribution.dra import SliceLookup, resolve_claim
from gpuid_agent.state.attribution.holders import (
    UNAVAILABLE,
    Allocation,
    Attribution,
    Claim,
    Holder,
    Unmapped,
)

PodLookup = Callable[[str, str], PodMeta | None]


def make_holder(
    namespace: str, pod: str, container: str, meta: PodMeta | None, label_allowlist: Sequence[str]
) -> Holder:
    if meta is None:
        return Holder(namespace, pod, container)
    labels = tuple((k, meta.labels[k]) for k in label_allowlist if k in meta.labels)
    return Holder(
        namespace,
        pod,
        container,
        pod_uid=meta.uid,
        workload_kind=meta.workload_kind,
        workload_name=meta.workload_name,
        labels=labels,
    )


def attribute(
    inventory: NodeInventory | None,
    snapshot: PodResourcesSnapshot | None,
    *,
    pods: PodLookup | None = None,
    label_allowlist: Sequence[str] = (),
    slices: SliceLookup | None = None,
) -> Attribution:
    """Map a kubelet snapshot onto the inventory. No snapshot (or a stale one): unavailable.
    No inventory yet: pending, nothing counted as unmapped. `slices` joins DRA devices to
    UUIDs; None when the node's ResourceSlices are not available (node-local fallback)."""
    if snapshot is None:
        return UNAVAILABLE
    if inventory is None:
        return Attribution("pending")
    index = DeviceIndex(inventory)
    allocations: list[Allocation] = []
    unmapped: list[Unmapped] = []
    holders: dict[tuple[str, str, str], Holder] = {}

    def holder_of(namespace: str, pod: str, container: str) -> Holder:
        key = (namespace, pod, container)
        holder = holders.get(key)
        if holder is None:
            meta = pods(namespace, pod) if pods is not None else None
            holder = holders[key] = make_holder(*key, meta, label_allowlist)
        return holder

    for a in snapshot.assignments:
        try:
            ref = parse_device_id(a.device_id)
            gpu, mig = index.resolve(ref)
        except DeviceIdError as exc:
            unmapped.append(_unmapped(a, exc.reason))
            continue
        holder = holder_of(a.namespace, a.pod, a.container)
        allocations.append(
            Allocation(
                holder=holder,
                resource_name=a.resource_name,
                device_id=a.device_id,
                gpu_uuid=gpu.uuid,
                mig_uuid=mig.uuid if mig is not None else None,
                replica=ref.replica,
            )
        )
    for c in snapshot.claims:
        try:
            gpu, mig, source = resolve_claim(c, index, slices)
        except DeviceIdError as exc:
            unmapped.append(_unmapped_claim(c, exc.reason))
            continue
        allocations.append(
            Allocation(
                holder=holder_of(c.namespace, c.pod, c.container),
                resource_name=c.driver,
                device_id=c.device_id,
                gpu_uuid=gpu.uuid,
                mig_uuid=mig.uuid if mig is not None else None,
                claim=Claim(c.claim_namespace, c.claim_name, source, c.share_id),
            )
        )
    return Attribution(
        "current",
        allocations=tuple(allocations),
        unmapped=tuple(unmapped),
        by_device=MappingProxyType(_by_device(allocations)),
    )


def _by_device(allocations: Iterable[Allocation]) -> dict[str, tuple[Holder, ...]]:
    grouped: dict[str, dict[Holder, None]] = {}
    for a in allocations:
        grouped.setdefault(a.mig_uuid or a.gpu_uuid, {})[a.holder] = None
    return {
        uuid: tuple(sorted(h, key=lambda h: (h.namespace, h.pod, h.container)))
        for uuid, h in grouped.items()
    }


def _unmapped(a: DeviceAssignment, reason: str) -> Unmapped:
    return Unmapped(a.namespace, a.pod, a.container, a.resource_name, a.device_id, reason)


def _unmapped_claim(c: ClaimAssignment, reason: str) -> Unmapped:
    return Unmapped(
        c.namespace,
        c.pod,
        c.container,
        c.driver,
        c.device_id,
        reason,
        claim=f"{c.claim_namespace}/{c.claim_name}",
    )


def count_allocatable_gpus(
    snapshot: PodResourcesSnapshot | None, inventory: NodeInventory | None
) -> int | None:
    """Physical GPUs the kubelet can hand out: replicas of one GPU count once, MIG devices
    count as their parent. Ids of GPUs NVML does not show (fallen off the bus) still count,
    which is the point: the kubelet's count is the one to compare NVML's with."""
    if snapshot is None or snapshot.allocatable is None:
        return None
    index = DeviceIndex(inventory) if inventory is not None else None
    gpus: set[tuple[str, object]] = set()
    for _, device_id in snapshot.allocatable:
        try:
            ref = parse_device_id(device_id)
        except DeviceIdError:
            continue
        if index is not None:
            try:
                gpus.add(("uuid", index.resolve(ref)[0].uuid))
                continue
            except DeviceIdError:
                pass
        if ref.gpu_uuid is not None:
            gpus.add(("uuid", ref.gpu_uuid.lower()))
        elif ref.gpu_index is not None:
            gpus.add(("index", ref.gpu_index))
        elif ref.gpu_minor is not None:
            gpus.add(("minor", ref.gpu_minor))
        else:  # a MIG UUID of a GPU NVML does not show: one GPU at least
            gpus.add(("mig", ref.mig_uuid))
    return len(gpus)
