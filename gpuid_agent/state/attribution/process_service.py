"""Keeps the node's per-process shares: NVML's process lists on the NVML thread, the host's
cgroup files in a worker thread, both once per collection and only with PROCESS_ATTRIBUTION
(off: no NVML process call, no /proc read). The shares are recomputed with every snapshot,
so a kubelet or pod change re-attributes the processes last read."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import NvmlError
from gpuid_agent.sources.kube.pods import PodDirectory
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.process_reader import ProcessReader
from gpuid_agent.sources.nvml.process_values import GpuProcesses
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.sources.procfs import CgroupOwner, HostProc
from gpuid_agent.state.attribution.holders import Attribution
from gpuid_agent.state.attribution.process_mapping import share_processes
from gpuid_agent.state.attribution.shares import PROCESSES_OFF, ProcessView

_log = log.get("processes")


class ProcessTracker:
    def __init__(self, *, enabled: bool, host_proc: str = "/proc") -> None:
        self.enabled = enabled
        self.host = HostProc(host_proc)
        self._reader = ProcessReader(FieldCalls(_log))
        self._readings: Mapping[str, GpuProcesses] = {}
        self._owners: Mapping[int, CgroupOwner | str] = {}
        self._error: str | None = None

    async def collect(self, nvml: NvmlSource, gpus: Sequence[GpuIdentity]) -> None:
        """Read every GPU's processes and their cgroups; a failure makes the view
        unavailable (with the reason) until the next collection reads again."""
        if not self.enabled:
            return
        api = nvml.reader.api
        try:
            readings = await nvml.run(lambda: self._reader.read(api, gpus), job="processes")
        except NvmlError as exc:
            if self._error is None:
                _log.warning("NVML process lists unreadable", extra={"error": str(exc)})
            self._error = f"NVML process lists: {exc}"
            return
        pids = {p.pid for r in readings.values() for p in r.processes}
        owners = await asyncio.to_thread(self.host.owners, pids) if pids else {}
        self._readings, self._owners, self._error = readings, owners, None

    def view(
        self,
        inventory: NodeInventory,
        samples: Mapping[str, GpuSample],
        attribution: Attribution,
        pods: PodDirectory | None,
        label_allowlist: Sequence[str],
    ) -> ProcessView:
        if not self.enabled:
            return PROCESSES_OFF
        if self._error is not None:
            return ProcessView("unavailable", reason=self._error)
        return share_processes(
            inventory,
            samples,
            attribution,
            self._readings,
            self._owners,
            by_uid=pods.by_uid if pods is not None else None,
            label_allowlist=label_allowlist,
        )
