"""Immutable facts about a node: what the sources read and what the sinks consume.

Everything here is frozen so one snapshot can be shared by the server, the record emitter and
the labeller without copies or locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Literal, NamedTuple

HealthState = Literal["healthy", "degraded", "unhealthy", "unknown"]


@dataclass(frozen=True, slots=True)
class PlatformInfo:
    """NVML platform info v2 (Blackwell+ rack systems such as GB200 NVL72)."""

    chassis_serial: str | None
    slot_number: int
    tray_index: int
    host_id: int
    peer_type: int
    module_id: int
    ib_guid: str | None = None


@dataclass(frozen=True, slots=True)
class MigDevice:
    index: int
    uuid: str
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    profile: str | None = None


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    """What identifies one physical GPU; any field NVML does not support is None."""

    index: int
    uuid: str
    serial: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    minor_number: int | None = None
    module_id: int | None = None
    board_part_number: str | None = None
    platform: PlatformInfo | None = None
    mig_enabled: bool | None = None
    mig_devices: tuple[MigDevice, ...] = ()

    @property
    def chassis_serial(self) -> str | None:
        return self.platform.chassis_serial if self.platform else None

    @property
    def device(self) -> str:
        """The device node name dcgm-exporter and GKE use (`nvidiaN`)."""
        minor = self.minor_number if self.minor_number is not None else self.index
        return f"nvidia{minor}"


@dataclass(frozen=True, slots=True)
class GpuSample:
    """Telemetry of one GPU (or MIG device) at one collection; keys are field ids."""

    uuid: str
    values: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """One consistent snapshot of the node."""

    node: str
    cluster: str
    machine: str
    machine_source: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GpuIdentity, ...]
    read_time: datetime

    def gpu_by_uuid(self) -> dict[str, GpuIdentity]:
        return {gpu.uuid: gpu for gpu in self.gpus}

    @property
    def chassis_serials(self) -> tuple[str, ...]:
        return tuple(sorted({g.chassis_serial for g in self.gpus if g.chassis_serial}))

    @property
    def serials(self) -> tuple[str, ...]:
        return tuple(sorted({g.serial for g in self.gpus if g.serial}))


class PcieLink(NamedTuple):
    """The PCIe link as trained now and at most (nvmlDevice{Curr,Max}PcieLink{Generation,Width}).

    `max_gen` is the most the GPU and its slot can do together; `gpu_max_gen` the GPU's own
    maximum (None on drivers without the call).
    """

    gen: int
    max_gen: int
    width: int
    max_width: int
    gpu_max_gen: int | None = None


class PcieAer(NamedTuple):
    """PCIe AER error counters of the GPU's link since the driver loaded
    (NVML_FI_DEV_PCIE_COUNT_{CORRECTABLE_ERRORS,NON_FATAL_ERROR,FATAL_ERROR}); None: not
    reported."""

    correctable: int | None
    non_fatal: int | None
    fatal: int | None


PCIE_AER_COUNTERS = PcieAer._fields


# NVML_NVLINK_ERROR_DL_* counter ids, in the order NvLink.errors holds them
NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")


class NvLink(NamedTuple):
    """One NVLink: active or not, its data-link error counters and its speed in MB/s (None:
    not reported)."""

    link: int
    active: bool
    errors: tuple[int | None, ...] = (None, None, None, None)
    speed_mbps: int | None = None
