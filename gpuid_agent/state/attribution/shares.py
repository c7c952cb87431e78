"""Per-process GPU shares as frozen snapshots: who uses how much of each GPU or MIG device.

Kept apart from the mapping (which reads NVML's and /proc's types) so renderers and reference
pages can use these without importing any source.

A device's shares always add up to the device's own figure where NVML gives one: attributed
holders, then unattributed rows by reason, then `unaccounted` (memory or SM time no listed
process explains: driver reservations, processes in other containers' PID namespaces NVML
hides). NVML reads the process list and the device figure at slightly different moments; a
process sum above the device figure is scaled down to it, so a sum over holders never exceeds
the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from gpuid_agent.state.attribution.holders import Holder

ProcessState = Literal["off", "current", "unavailable"]
UNACCOUNTED = "unaccounted"
UNKNOWN_POD = "unknown_pod"  # a pod UID the pod cache does not know (or no API access)
# the reasons a process is not attributed (the first three come from /proc)
UNATTRIBUTED_REASONS = (
    "host_process",
    "unknown_cgroup",
    "pid_gone",
    "proc_unreadable",
    UNKNOWN_POD,
    UNACCOUNTED,
)

# What the kubelet says about a device against what runs on it, for alerts:
# held_busy, held_idle ("idle but allocated"), unowned_busy ("busy but unowned"), free; and
# held / unowned where nothing tells whether it is in use (a MIG device reports no
# utilization of its own: without process attribution its use is unknown).
UsageState = Literal["held_busy", "held_idle", "unowned_busy", "free", "held", "unowned"]
USAGE_STATES: tuple[UsageState, ...] = (
    "held_busy",
    "held_idle",
    "unowned_busy",
    "free",
    "held",
    "unowned",
)


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """One process on one device."""

    pid: int
    holder: Holder | None  # None: unattributed, `reason` says why
    reason: str
    memory_bytes: int | None  # None where the driver does not say
    sm_util: float | None  # percent; None without per-process samples
    allocated: bool = False  # its container holds this device through the kubelet


@dataclass(frozen=True, slots=True)
class Share:
    """The processes of one holder (or one unattributed reason) on one device, summed."""

    holder: Holder | None
    reason: str  # "" for a holder
    memory_bytes: float | None
    sm_util: float | None  # percent of the device
    processes: int
    allocated: bool = False


@dataclass(frozen=True, slots=True)
class DeviceShares:
    uuid: str  # GPU or MIG UUID
    processes: tuple[ProcessUse, ...] = ()
    shares: tuple[Share, ...] = ()
    scaled: bool = False  # the processes' sum exceeded the device figure and was scaled down

    @property
    def unattributed(self) -> tuple[Share, ...]:
        return tuple(s for s in self.shares if s.holder is None)


@dataclass(frozen=True, slots=True)
class ProcessView:
    state: ProcessState
    devices: Mapping[str, DeviceShares] = field(default_factory=lambda: MappingProxyType({}))
    reason: str = ""  # why unavailable

    def device(self, uuid: str) -> DeviceShares | None:
        return self.devices.get(uuid)


PROCESSES_OFF = ProcessView("off")


def usage_state(held: bool, util_percent: float | None, shares: DeviceShares | None) -> UsageState:
    """Busy: the device reports utilization above zero, or a process runs on it (where
    process attribution is on). With neither figure its use is unknown."""
    if util_percent is None and shares is None:
        return "held" if held else "unowned"
    busy = (util_percent or 0) > 0 or (shares is not None and bool(shares.processes))
    if held:
        return "held_busy" if busy else "held_idle"
    return "unowned_busy" if busy else "free"
