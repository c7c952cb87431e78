"""The kubelet pod-resources API: which containers hold which GPU devices."""

from gpuid_agent.runtime.errors import DeviceIdError, PodResourcesError
from gpuid_agent.sources.kubelet.claims import (
    GPU_DRIVERS,
    NVIDIA_GPU_DRIVER,
    ClaimAssignment,
    DraDeviceName,
    parse_dra_device,
)
from gpuid_agent.sources.kubelet.client import PodResourcesClient
from gpuid_agent.sources.kubelet.devices import DeviceRef, ResourceMatcher, parse_device_id
from gpuid_agent.sources.kubelet.source import (
    DeviceAssignment,
    PodResourcesSnapshot,
    PodResourcesSource,
    snapshot_from,
)

__all__ = [
    "GPU_DRIVERS",
    "NVIDIA_GPU_DRIVER",
    "ClaimAssignment",
    "DeviceAssignment",
    "DeviceIdError",
    "DeviceRef",
    "DraDeviceName",
    "PodResourcesClient",
    "PodResourcesError",
    "PodResourcesSnapshot",
    "PodResourcesSource",
    "ResourceMatcher",
    "parse_device_id",
    "parse_dra_device",
    "snapshot_from",
]
