"""The processes using each GPU, as NVML reports them, read on the NVML thread.

Per GPU: the running compute processes and the processes under MPS (pid, GPU memory, and the
GPU/compute instance on a MIG GPU), and per-process utilization samples taken since the last
read. A driver without one of the calls, or a GPU that does not support it (NOT_SUPPORTED),
leaves that part absent; the rest is still read. PIDs are host PIDs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime.errors import GpuLostError
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.process_values import GpuProcesses, ProcessInfo, ProcessSample

NO_INSTANCE = 0xFFFFFFFF  # NVML's "not a MIG process" instance id
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE for a ulonglong


def instance_id(value: object) -> int | None:
    as_int = int(value) if isinstance(value, int) else None
    return None if as_int is None or as_int == NO_INSTANCE else as_int


def memory_value(value: object) -> int | None:
    if not isinstance(value, int) or value < 0 or value >= NOT_AVAILABLE:
        return None
    return value


class ProcessReader:
    """Reads every GPU's processes and samples; one per NvmlSource, used on its thread."""

    def __init__(self, calls: FieldCalls) -> None:
        self._calls = calls
        self._last_seen: dict[str, int] = {}  # GPU UUID → newest sample timestamp read

    def read(self, api: NvmlApi, gpus: Sequence[GpuIdentity]) -> dict[str, GpuProcesses]:
        return {gpu.uuid: self._gpu(api, gpu) for gpu in gpus}

    def _gpu(self, api: NvmlApi, gpu: GpuIdentity) -> GpuProcesses:
        get, i = self._calls.get, gpu.index
        try:
            handle = get(i, "handle", api.handle_by_index, i)
            if handle is None:
                return GpuProcesses(gpu.uuid, failed="no handle")
            compute = get(i, "compute_processes", api.compute_processes, handle) or []
            mps = get(i, "mps_processes", api.mps_processes, handle) or []
            since = self._last_seen.get(gpu.uuid, 0)
            samples = get(i, "process_utilization", api.process_utilization, handle, since)
        except GpuLostError as exc:
            return GpuProcesses(gpu.uuid, failed=exc.reason)
        seen: dict[int, ProcessInfo] = {}
        for proc in [*compute, *mps]:
            seen.setdefault(proc.pid, proc)  # a process in both lists is counted once
        return GpuProcesses(gpu.uuid, tuple(seen.values()), self._sm(gpu.uuid, samples))

    def _sm(self, uuid: str, samples: Sequence[ProcessSample] | None) -> dict[int, float] | None:
        if samples is None:
            return None
        per_pid: dict[int, list[int]] = defaultdict(list)
        newest = self._last_seen.get(uuid, 0)
        for s in samples:
            per_pid[s.pid].append(min(max(s.sm_util, 0), 100))
            newest = max(newest, s.timestamp_us)
        self._last_seen[uuid] = newest
        return {pid: sum(v) / len(v) for pid, v in per_pid.items()}
