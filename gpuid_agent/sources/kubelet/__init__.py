"""The kubelet pod-resources API: which containers hold which GPU devices."""

from gpuid_agent.sources.kubelet.client import PodResourcesClient, PodResourcesError
from gpuid_agent.sources.kubelet.devices import (
    DeviceIdError,
    DeviceRef,
    ResourceMatcher,
    parse_device_id,
)
from gpuid_agent.sources.kubelet.source import (
    DeviceAssignment,
    PodResourcesSnapshot,
    PodResourcesSource,
    snapshot_from,
)

__all__ = [
    "DeviceAssignment",
    "DeviceIdError",
    "DeviceRef",
    "PodResourcesClient",
    "PodResourcesError",
    "PodResourcesSnapshot",
    "PodResourcesSource",
    "ResourceMatcher",
    "parse_device_id",
    "snapshot_from",
]
