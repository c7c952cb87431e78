"""Raw health signals read from NVML: values only, no judgement (that is `state.health`).

A signal NVML does not support is None with the reason in `absent`; one NVML failed to read is
None with the reason in `failed`, so the evaluator can tell "not supported here" from "could
not be read this time".
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import NamedTuple

from gpuid_agent.facts import NVLINK_COUNTERS, NvLink, PcieAer, PcieLink

__all__ = ["NVLINK_COUNTERS", "NvLink", "PcieAer", "PcieLink"]


class RemappedRows(NamedTuple):
    """nvmlDeviceGetRemappedRows (Ampere+): rows remapped and the remapper's state."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


class FabricInfo(NamedTuple):
    """nvmlDeviceGetGpuFabricInfoV: NVLink fabric registration of a GPU (Hopper+, GB200).

    `health_summary` exists only in the v3 structure (newer drivers); None otherwise.
    """

    state: int
    status: int
    health_mask: int
    clique_id: int
    cluster_uuid: str | None
    health_summary: int | None = None


class EccCounts(NamedTuple):
    """nvmlDeviceGetTotalEccErrors; each counter None when NVML does not report it."""

    volatile_corrected: int | None
    volatile_uncorrected: int | None
    aggregate_corrected: int | None
    aggregate_uncorrected: int | None


class NvmlEvent(NamedTuple):
    """One nvmlEventSetWait result; `device` is comparable with `NvmlApi.device_key`."""

    device: Hashable
    event_type: int
    data: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID the driver reported for one GPU (a MIG instance's XID names its parent GPU)."""

    index: int
    uuid: str
    code: int
    at: datetime
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class GpuHealthSignals:
    """What one pass read for one GPU's health checks."""

    index: int
    uuid: str
    ecc: EccCounts | None = None
    retired_pages_pending: bool | None = None
    remapped_rows: RemappedRows | None = None
    clocks_event_reasons: int | None = None
    fabric: FabricInfo | None = None
    persistence_mode: int | None = None
    recovery_action: int | None = None  # NVML field 230: nvmlDeviceGpuRecoveryAction_t
    pcie: PcieLink | None = None
    nvlinks: tuple[NvLink, ...] | None = None  # None: the GPU has no NVLink
    pcie_aer: PcieAer | None = None
    pcie_replays: int | None = None  # the telemetry read's counter, for the PCIe check
    utilization: float | None = None  # GPU busy percent from the telemetry read
    lost: str | None = None  # a call said GPU_IS_LOST / RESET_REQUIRED
    absent: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    failed: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
