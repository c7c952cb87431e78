"""The node the agent runs on, as its sources see it: the NVML library, the kubelet's
pod-resources socket and the host's machine identity. A simulated node
(`gpuid_agent.simulate.environment`) offers the same surface, so the wiring never asks which
one it has."""

from __future__ import annotations

from typing import Any, Protocol

from gpuid_agent.runtime.config import Settings
from gpuid_agent.sources.kube.pods import PodDirectory
from gpuid_agent.sources.machine import local_machine_id
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi


class NodeEnvironment(Protocol):
    nvml_api: NvmlApi
    pod_resources_socket: str
    # per-process shares: on or off, the host's /proc, and (simulated node only) the pods
    # without an API server
    process_attribution: bool
    host_proc: str
    pod_directory: PodDirectory | None

    def machine(self) -> tuple[str, str]:
        """(machine id, where it came from) before the Kubernetes API says better."""
        ...

    def resource_slices(self) -> list[dict[str, Any]] | None:
        """DRA ResourceSlices the node itself provides (a simulated node); None: ask the API."""
        ...

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class HostNode:
    """A real GPU node: the driver's NVML and the kubelet's socket."""

    def __init__(self, settings: Settings, nvml_api: NvmlApi | None = None) -> None:
        self._settings = settings
        self.nvml_api: NvmlApi = nvml_api or PynvmlApi(settings.nvml_library_path)
        self.pod_resources_socket = settings.pod_resources_socket
        self.process_attribution = settings.process_attribution
        self.host_proc = settings.host_proc
        self.pod_directory: PodDirectory | None = None

    def machine(self) -> tuple[str, str]:
        s = self._settings
        found = local_machine_id(s.dmi_product_uuid_path, s.machine_id_path)
        return found if found else (s.effective_node_name(), "node_name")

    def resource_slices(self) -> list[dict[str, Any]] | None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
