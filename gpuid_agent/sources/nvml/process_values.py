"""What NVML says about the processes on a GPU: the values `NvmlApi` returns and the reader
gathers per GPU (host PIDs, memory, MIG instance, utilization samples)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process on one GPU, from a running-processes list."""

    pid: int
    used_memory: int | None  # bytes; None where the driver does not say
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    mps: bool = False


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One per-process utilization sample (percent of the sampling period)."""

    pid: int
    timestamp_us: int
    sm_util: int
    mem_util: int = 0


@dataclass(frozen=True, slots=True)
class GpuProcesses:
    """What NVML said about one GPU's processes at one read."""

    gpu_uuid: str
    processes: tuple[ProcessInfo, ...] = ()
    # None: the driver gives no per-process samples here; {}: none ran since the last read
    sm_util: dict[int, float] | None = None
    failed: str | None = None  # the whole GPU could not be read (lost)
