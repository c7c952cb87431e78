"""Which containers hold which GPUs: kubelet device ids mapped onto the NVML inventory."""

from gpuid_agent.attribution.mapping import (
    UNAVAILABLE,
    Allocation,
    Attribution,
    DeviceIndex,
    Holder,
    Unmapped,
    attribute,
    count_allocatable_gpus,
    make_holder,
)

__all__ = [
    "UNAVAILABLE",
    "Allocation",
    "Attribution",
    "DeviceIndex",
    "Holder",
    "Unmapped",
    "attribute",
    "count_allocatable_gpus",
    "make_holder",
]
