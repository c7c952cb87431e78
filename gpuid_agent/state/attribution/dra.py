"""DRA claim devices joined to the GPUs and MIG devices of the NVML inventory.

The join goes through the node's ResourceSlices: (driver, pool, device) → attribute `uuid`,
which is a GPU's or a MIG device's UUID. Without the slices (no API access, resource.k8s.io
not served) or before the driver has published a device, a full GPU's device name still gives
its minor number (`gpu-<minor>` → /dev/nvidia<minor>), and the allocation says it came from
that fallback. A MIG device's name (`gpu-<minor>-mig-<profileID>-<start>-<size>`) gives its
GPU instance profile id and placement, which the inventory does not read from NVML (only the
GPU instance id and the profile's name), so a MIG device waits for the slices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from gpuid_agent.facts import GpuIdentity, MigDevice
from gpuid_agent.runtime.errors import DeviceIdError
from gpuid_agent.sources.kube.resourceslices import SliceDevice
from gpuid_agent.sources.kubelet import ClaimAssignment, parse_dra_device
from gpuid_agent.sources.kubelet.claims import NVIDIA_GPU_DRIVER
from gpuid_agent.state.attribution.device_index import DeviceIndex
from gpuid_agent.state.attribution.holders import ClaimSource

SliceLookup = Callable[[str, str, str], SliceDevice | None]


def resolve_claim(
    claim: ClaimAssignment, index: DeviceIndex, slices: SliceLookup | None
) -> tuple[GpuIdentity, MigDevice | None, ClaimSource]:
    """The GPU (and MIG device) a claimed device is and how that was found; DeviceIdError
    (with a stable reason) when it cannot be told."""
    if slices is not None:
        found = slices(claim.driver, claim.pool, claim.device)
        if found is not None and found.uuid:
            key = found.uuid.lower()
            if (mig := index.mig_by_uuid.get(key)) is not None:
                return mig[0], mig[1], "dra"
            if (gpu := index.by_uuid.get(key)) is not None:
                return gpu, None, "dra"
            if key in index.shared:
                raise DeviceIdError("ambiguous_uuid", "the slice's uuid is reported by two GPUs")
            raise DeviceIdError("unknown_gpu", f"slice uuid {found.uuid[:80]} names no GPU here")
    name = parse_dra_device(claim.device)
    if name.kind == "mig":
        why = "not in the node's ResourceSlices" if slices is not None else "needs ResourceSlices"
        raise DeviceIdError("dra_mig_unresolved", f"MIG device {claim.device}: {why}")
    gpu = index.by_device.get(f"nvidia{name.minor}")
    if gpu is None:
        raise DeviceIdError("unknown_gpu", f"no GPU with minor number {name.minor} here")
    return gpu, None, "dra-fallback"


def slice_gpu_count(devices: Iterable[SliceDevice]) -> int:
    """Physical GPUs NVIDIA's DRA driver publishes for the node. A GPU in MIG mode may be
    listed only through its MIG devices, so each device counts as the GPU whose minor number
    its name carries (`gpu-<minor>`, `gpu-<parentMinor>-mig-…`), and each GPU once."""
    minors: set[int] = set()
    for device in devices:
        if device.driver != NVIDIA_GPU_DRIVER:
            continue
        try:
            minors.add(parse_dra_device(device.name).minor)
        except DeviceIdError:
            continue
    return len(minors)
