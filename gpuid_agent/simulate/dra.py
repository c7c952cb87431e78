"""A simulated node under NVIDIA's DRA driver: pods consuming ResourceClaims (a claim shared by
two pods, MIG devices created for claims, another driver's NIC claim) as the kubelet reports
them, and the ResourceSlice the driver would publish for the node, both built from the
simulated GPUs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuid_agent.simulate.pods import ClaimDevice, KubeletClaim, KubeletPod, claim_pod
from gpuid_agent.simulate.profiles import SimGpu, SimMig
from gpuid_agent.sources.kubelet.claims import NVIDIA_GPU_DRIVER

# H100 80GB GPU instance profiles as NVML gives them: profile id, placement size (in memory
# slices) and the placement starts the profile may take
_H100_PROFILES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "1g.10gb": (19, 1, (0, 1, 2, 3, 4, 5, 6)),
    "1g.20gb": (15, 2, (0, 2, 4, 6)),
    "2g.20gb": (14, 2, (0, 2, 4)),
    "3g.40gb": (9, 4, (0, 4)),
    "4g.40gb": (5, 4, (0,)),
    "7g.80gb": (0, 8, (0,)),
}


def mig_placements(gpu: SimGpu) -> dict[str, tuple[int, int, int]]:
    """(profile id, placement start, placement size) of each of the GPU's MIG devices by UUID:
    its instances placed in order, each at the first free start its profile may take."""
    used: set[int] = set()
    placed: dict[str, tuple[int, int, int]] = {}
    for mig in gpu.mig:
        profile_id, size, starts = _H100_PROFILES[mig.name.rsplit(" ", 1)[-1]]
        start = next(s for s in starts if used.isdisjoint(range(s, s + size)))
        used.update(range(start, start + size))
        placed[mig.uuid] = (profile_id, start, size)
    return placed


def mig_device_name(gpu: SimGpu, mig: SimMig) -> str:
    """The name NVIDIA's driver gives the device: `gpu-<minor>-mig-<profileID>-<start>-<size>`."""
    profile_id, start, size = mig_placements(gpu)[mig.uuid]
    return f"gpu-{gpu.minor_number}-mig-{profile_id}-{start}-{size}"


def _claim(namespace: str, name: str, pool: str, *devices: str) -> KubeletClaim:
    return KubeletClaim(
        namespace,
        name,
        tuple(
            ClaimDevice(
                NVIDIA_GPU_DRIVER, pool, d, cdi_devices=(f"k8s.gpu.nvidia.com/claim={name}",)
            )
            for d in devices
        ),
    )


def dra_pods(gpus: Sequence[SimGpu], node: str) -> list[KubeletPod]:
    """Each MIG device but the last claimed by its own pod; the first whole GPU shared by two
    pods through one claim; the next two claimed by a training pod; the rest free."""
    pods: list[KubeletPod] = []
    for gpu in gpus:
        for j, mig in enumerate(gpu.mig[:-1]):
            name = f"mig-job-{j}"
            claim = _claim("research", f"{name}-mig", node, mig_device_name(gpu, mig))
            pods.append(claim_pod("research", name, "worker", claim))
    whole = [g for g in gpus if not g.mig]
    if whole:
        shared = _claim("inference", "llm-shared-gpu", node, f"gpu-{whole[0].minor_number}")
        pods += [claim_pod("inference", f"llm-serve-{r}", "server", shared) for r in range(2)]
    if len(whole) >= 3:
        train = _claim("ml", "train-gpus", node, *(f"gpu-{g.minor_number}" for g in whole[1:3]))
        pods.append(claim_pod("ml", "train-0", "trainer", train))
    nic = KubeletClaim("net", "rdma-nic", (ClaimDevice("dra.net", node, "eth1"),))
    pods.append(claim_pod("net", "rdma-probe", "probe", nic))  # not a GPU: ignored
    return pods


def _attributes(uuid: str, product: str, parent: str | None = None) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "type": {"string": "mig" if parent else "gpu"},
        "uuid": {"string": uuid},
        "productName": {"string": product},
    }
    if parent is not None:
        attributes["parentUUID"] = {"string": parent}
    return attributes


def dra_slices(gpus: Sequence[SimGpu], node: str) -> list[dict[str, Any]]:
    """The node's ResourceSlice (resource.k8s.io/v1 layout): every whole GPU and every MIG
    device with its `uuid` (and `parentUUID`)."""
    devices: list[dict[str, Any]] = []
    for gpu in gpus:
        if not gpu.mig:
            name = f"gpu-{gpu.minor_number}"
            devices.append({"name": name, "attributes": _attributes(gpu.uuid, gpu.name)})
        for mig in gpu.mig:
            devices.append(
                {
                    "name": mig_device_name(gpu, mig),
                    "attributes": _attributes(mig.uuid, mig.name, gpu.uuid),
                }
            )
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{NVIDIA_GPU_DRIVER}-sim"},
            "spec": {
                "driver": NVIDIA_GPU_DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    ]
