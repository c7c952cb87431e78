"""The simulated node's pods: which containers hold which GPUs, MIG devices and DRA claims,
in the shape the kubelet reports them (served by `simulate.kubelet`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuid_agent.simulate.profiles import SimGpu

Devices = tuple[tuple[str, tuple[str, ...]], ...]  # (resource name, device ids) per request


@dataclass(frozen=True, slots=True)
class ClaimDevice:
    """One device allocated to a DRA claim (share_id: a share of a consumable device)."""

    driver: str
    pool: str
    device: str
    share_id: str | None = None
    cdi_devices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KubeletClaim:
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...] = ()


@dataclass(frozen=True, slots=True)
class KubeletContainer:
    name: str
    devices: Devices = ()
    claims: tuple[KubeletClaim, ...] = ()


@dataclass(frozen=True, slots=True)
class KubeletPod:
    namespace: str
    name: str
    containers: tuple[KubeletContainer, ...] = ()


def pod(namespace: str, name: str, container: str, resource: str, *ids: str) -> KubeletPod:
    """A one-container pod holding `ids` of `resource`."""
    return KubeletPod(namespace, name, (KubeletContainer(container, ((resource, ids),)),))


def claim_pod(namespace: str, name: str, container: str, *claims: KubeletClaim) -> KubeletPod:
    """A one-container pod consuming DRA `claims`."""
    return KubeletPod(namespace, name, (KubeletContainer(container, claims=claims),))


def simulated_pods(gpus: Sequence[SimGpu]) -> tuple[list[KubeletPod], Devices]:
    """Pods on a simulated node: one GPU time-shared by three pods, each MIG device but the last
    held by its own pod, a four-GPU training pod, a notebook; the rest stays free."""
    pods: list[KubeletPod] = []
    allocatable: list[tuple[str, tuple[str, ...]]] = []
    whole = [g for g in gpus if not g.mig]
    for gpu in gpus:
        for j, mig in enumerate(gpu.mig):
            profile = mig.name.rsplit(" ", 1)[-1]
            resource = f"nvidia.com/mig-{profile}"
            allocatable.append((resource, (mig.uuid,)))
            if j < len(gpu.mig) - 1:
                pods.append(pod("research", f"mig-job-{j}", "worker", resource, mig.uuid))
    if whole:
        shared = whole.pop(0)
        replicas = tuple(f"{shared.uuid}::{r}" for r in range(4))
        allocatable.append(("nvidia.com/gpu", replicas))
        pods.extend(
            pod("inference", f"llm-serve-{r}", "server", "nvidia.com/gpu", replicas[r])
            for r in range(3)
        )
    allocatable.extend(("nvidia.com/gpu", (g.uuid,)) for g in whole)
    train = whole[:4] if len(whole) >= 5 else whole[: max(0, len(whole) - 1)]
    if train:
        ids = tuple(g.uuid for g in train)
        pods.append(pod("ml", "train-0", "trainer", "nvidia.com/gpu", *ids))
    rest = whole[len(train) :]
    if rest:
        pods.append(pod("default", "notebook", "jupyter", "nvidia.com/gpu", rest[0].uuid))
    return pods, tuple(allocatable)
