"""The simulated node SIMULATE names: a Python NVML and an in-process kubelet serving pods for
the simulated GPUs (unless POD_RESOURCES_SOCKET points at another kubelet, as the benchmarks
do). A DRA profile's pods consume claims, and the node offers the ResourceSlice its DRA driver
would publish. It offers the host node's surface (`sources.host.NodeEnvironment`); the wiring
picks one of the two (`gpuid_agent.setup.environment`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpuid_agent.simulate.dra import dra_pods, dra_slices
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.simulate.pods import Devices, KubeletPod, simulated_pods
from gpuid_agent.simulate.process_tree import plan_processes
from gpuid_agent.simulate.profiles import DRA_PROFILES, PROCESS_PROFILES
from gpuid_agent.sources.kube.pods import PodDirectory
from gpuid_agent.sources.nvml.api import NvmlApi

if TYPE_CHECKING:
    from gpuid_agent.simulate.kubelet import FakeKubelet


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    profile: str  # SIMULATE
    node: str
    faults: tuple[str, ...]  # FAULT
    # POD_RESOURCES_SOCKET when set explicitly (another kubelet); None: serve one of our own
    pod_resources_socket: str | None
    process_attribution: bool
    process_attribution_set: bool  # PROCESS_ATTRIBUTION set explicitly (a profile's default)
    host_proc: str


class SimulatedNode:
    def __init__(self, config: SimulationConfig, nvml_api: NvmlApi | None = None) -> None:
        self._node = config.node
        self._dra = config.profile in DRA_PROFILES
        self.nvml_api: NvmlApi = nvml_api or SimulatedNvml(
            config.profile, self._node, config.faults
        )
        self._dir: str | None = None
        self._kubelet: FakeKubelet | None = None
        if config.pod_resources_socket is not None:
            self.pod_resources_socket = config.pod_resources_socket
        else:
            self._dir = tempfile.mkdtemp(prefix="gpuid-kubelet-")
            self.pod_resources_socket = os.path.join(self._dir, "kubelet.sock")
        self.process_attribution = config.process_attribution
        self.host_proc = config.host_proc
        self.pod_directory: PodDirectory | None = None
        api = self.nvml_api
        if self._dir is not None and isinstance(api, SimulatedNvml):
            self._pods: tuple[list[KubeletPod], Devices] = (
                # DRA: no device plugin, so the kubelet has no GPU to allocate itself
                (dra_pods(api.gpus, self._node), ()) if self._dra else simulated_pods(api.gpus)
            )
            if config.profile in PROCESS_PROFILES:
                # its pods run processes: shares on, over a /proc of its own
                self.host_proc = os.path.join(self._dir, "proc")
                self.pod_directory = plan_processes(
                    self._node, api.gpus, self._pods[0], self.host_proc
                )
                # on unless PROCESS_ATTRIBUTION was set explicitly (the benchmark's "off")
                if not config.process_attribution_set:
                    self.process_attribution = True

    def machine(self) -> tuple[str, str]:
        return f"sim-{self._node}", "simulated"

    def resource_slices(self) -> list[dict[str, Any]] | None:
        """The ResourceSlices a DRA profile's driver publishes (no API server here)."""
        if not self._dra or not isinstance(self.nvml_api, SimulatedNvml):
            return None
        return dra_slices(self.nvml_api.gpus, self._node)

    async def start(self) -> None:
        if self._dir is None or not isinstance(self.nvml_api, SimulatedNvml):
            return
        # grpcio only where the simulation serves its own kubelet: a node's agent never loads it
        from gpuid_agent.simulate.kubelet import FakeKubelet

        pods, allocatable = self._pods
        self._kubelet = FakeKubelet(self.pod_resources_socket, pods, allocatable)
        await self._kubelet.start()

    async def stop(self) -> None:
        if self._kubelet is not None:
            await self._kubelet.stop()
            self._kubelet = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
