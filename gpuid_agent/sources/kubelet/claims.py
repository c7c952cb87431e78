"""Devices the kubelet reports as allocated through Dynamic Resource Allocation (DRA) claims.

pod-resources v1 lists, per container, `dynamic_resources`: the claim (name, namespace) and
per allocated device its driver, pool and device name (and, with consumable capacity, the
share of the device). Only NVIDIA's GPU driver is kept; other drivers' devices (NICs, compute
domains, …) are not GPUs.

NVIDIA's DRA driver names its devices

    gpu-<minor>                                    a full GPU (/dev/nvidia<minor>)
    gpu-<minor>-mig-<profileID>-<start>-<size>     a MIG device on that GPU

where profileID is the GPU instance profile id and start/size its placement in memory slices
(`gpu-0-mig-9-0-4`: a 3g.40gb instance at slice 0 of an H100). A name with the profile's name
in it (`gpu-0-mig-3g.40gb-9-0`) is no form of the driver's: ResourceSlice device names are DNS
labels, so it never produced one with a dot, and such a name is `unknown_form`.

Its CDI device names carry the claim UID, not a GPU UUID: which GPU a device is comes from the
node's ResourceSlices (attribute `uuid`), or for a full GPU from the minor number in its name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from gpuid_agent.runtime.errors import DeviceIdError
from gpuid_agent.sources.kubelet.devices import check_id_text, id_number

NVIDIA_GPU_DRIVER = "gpu.nvidia.com"
GPU_DRIVERS = frozenset({NVIDIA_GPU_DRIVER})
MAX_DEVICE_NAME = 63  # a ResourceSlice device name is a DNS label

_GPU = re.compile(r"gpu-(\d{1,5})")
_MIG = re.compile(r"gpu-(\d{1,5})-mig-(\d{1,5})-(\d{1,5})-(\d{1,5})")


@dataclass(frozen=True, slots=True)
class DraDeviceName:
    """What an NVIDIA DRA device name says: the GPU's minor number and, for MIG, the GPU
    instance profile id and placement (start and size, in memory slices)."""

    name: str
    kind: Literal["gpu", "mig"]
    minor: int
    profile_id: int | None = None
    placement_start: int | None = None
    placement_size: int | None = None


def parse_dra_device(name: str) -> DraDeviceName:
    """Parse an NVIDIA DRA device name; DeviceIdError (with a stable reason) otherwise."""
    check_id_text(name, "DRA device name", MAX_DEVICE_NAME)
    if match := _GPU.fullmatch(name):
        return DraDeviceName(name, "gpu", id_number(match.group(1)))
    if match := _MIG.fullmatch(name):
        minor, profile_id, start, size = match.groups()
        return DraDeviceName(
            name,
            "mig",
            id_number(minor),
            profile_id=id_number(profile_id),
            placement_start=id_number(start),
            placement_size=id_number(size),
        )
    raise DeviceIdError("unknown_form", "DRA device name fits no NVIDIA GPU or MIG form")


@dataclass(frozen=True, slots=True)
class ClaimAssignment:
    """One device of one DRA claim consumed by one container, as the kubelet reports it."""

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    driver: str
    pool: str
    device: str
    share_id: str | None = None

    @property
    def device_id(self) -> str:
        """`<pool>/<device>` (`/<share>` appended for a shared device): unique per claim."""
        base = f"{self.pool}/{self.device}"
        return f"{base}/{self.share_id}" if self.share_id else base


def claims_from(
    containers: Iterable[tuple[str, str, str, Iterable[Any]]],
) -> tuple[tuple[ClaimAssignment, ...], frozenset[str]]:
    """GPU devices of the DRA claims of each (namespace, pod, container, its
    `dynamic_resources`) of a List response, and the other drivers' names seen (ignored)."""
    found: set[ClaimAssignment] = set()
    ignored: set[str] = set()
    for namespace, pod, container, dynamic in containers:
        for claim in dynamic:
            for resource in claim.claim_resources:
                if resource.driver_name not in GPU_DRIVERS:
                    ignored.add(resource.driver_name[:100])
                    continue
                share = resource.share_id if resource.HasField("share_id") else None
                found.add(
                    ClaimAssignment(
                        namespace,
                        pod,
                        container,
                        claim.claim_namespace or namespace,
                        claim.claim_name,
                        resource.driver_name,
                        resource.pool_name,
                        resource.device_name,
                        share or None,
                    )
                )
    ordered = sorted(
        found,
        key=lambda c: (c.namespace, c.pod, c.container, c.claim_name, c.driver, c.device_id),
    )
    return tuple(ordered), frozenset(ignored)
