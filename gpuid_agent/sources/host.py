"""The node the agent runs on, as its sources see it: the NVML library, the kubelet's
pod-resources socket and the host's machine identity. A simulated node
(`gpuid_agent.simulate.node`) offers the same surface: the wiring picks one once
(`gpuid_agent.setup.environment`) and never asks again which one it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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


@dataclass(frozen=True, slots=True)
class HostConfig:
    node: str
    nvml_library_path: str
    pod_resources_socket: str
    process_attribution: bool
    host_proc: str
    dmi_product_uuid_path: str
    machine_id_path: str


class HostNode:
    """A real GPU node: the driver's NVML and the kubelet's socket."""

    def __init__(self, config: HostConfig, nvml_api: NvmlApi | None = None) -> None:
        self._config = config
        self.nvml_api: NvmlApi = nvml_api or PynvmlApi(config.nvml_library_path)
        self.pod_resources_socket = config.pod_resources_socket
        self.process_attribution = config.process_attribution
        self.host_proc = config.host_proc
        self.pod_directory: PodDirectory | None = None

    def machine(self) -> tuple[str, str]:
        c = self._config
        found = local_machine_id(c.dmi_product_uuid_path, c.machine_id_path)
        return found if found else (c.node, "node_name")

    def resource_slices(self) -> list[dict[str, Any]] | None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
