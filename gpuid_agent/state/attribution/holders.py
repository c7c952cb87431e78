"""What attribution produces: holders of GPUs and MIG devices, as frozen snapshots.

Kept apart from the mapping (which reads the kubelet's and the API's types) so renderers and
reference pages can use these without importing any source.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

AttributionState = Literal["current", "pending", "unavailable"]
# How a DRA device was joined to its GPU: through the node's ResourceSlices, or node-locally
# (minor number in the device name, full GPUs only) when the slices cannot be read.
ClaimSource = Literal["dra", "dra-fallback"]


@dataclass(frozen=True, slots=True)
class Holder:
    """A container holding a GPU or MIG device, with what the API added (empty without it)."""

    namespace: str
    pod: str
    container: str
    pod_uid: str = ""
    workload_kind: str = ""
    workload_name: str = ""
    labels: tuple[tuple[str, str], ...] = ()  # allowed pod labels, in allow-list order


@dataclass(frozen=True, slots=True)
class Claim:
    """The DRA claim an allocation came through, and how its device was joined."""

    namespace: str
    name: str
    source: ClaimSource = "dra"
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class Allocation:
    """One device id of one container, mapped to a GPU (and MIG device) of this node.
    Through a DRA claim, `resource_name` is the driver and `device_id` `<pool>/<device>`."""

    holder: Holder
    resource_name: str
    device_id: str
    gpu_uuid: str
    mig_uuid: str | None = None
    replica: int | None = None
    claim: Claim | None = None


@dataclass(frozen=True, slots=True)
class Unmapped:
    """A device id that could not be attributed, and why (a short, stable reason)."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_id: str
    reason: str
    claim: str = ""  # `<namespace>/<name>` of a DRA claim


@dataclass(frozen=True, slots=True)
class Attribution:
    state: AttributionState
    allocations: tuple[Allocation, ...] = ()
    unmapped: tuple[Unmapped, ...] = ()
    # GPU or MIG UUID → its distinct holders (one per container, even with several replicas)
    by_device: Mapping[str, tuple[Holder, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def holders(self, device_uuid: str) -> tuple[Holder, ...]:
        return self.by_device.get(device_uuid, ())


UNAVAILABLE = Attribution("unavailable")
