"""Which containers hold which GPUs: kubelet device ids mapped onto the NVML inventory."""

from gpuid_agent.state.attribution.device_index import DeviceIndex
from gpuid_agent.state.attribution.holders import (
    UNAVAILABLE,
    Allocation,
    Attribution,
    Claim,
    Holder,
    Unmapped,
)
from gpuid_agent.state.attribution.mapping import (
    attribute,
    count_allocatable_gpus,
    make_holder,
)

__all__ = [
    "UNAVAILABLE",
    "Allocation",
    "Attribution",
    "Claim",
    "DeviceIndex",
    "Holder",
    "Unmapped",
    "attribute",
    "count_allocatable_gpus",
    "make_holder",
]
