"""The node the agent reads, chosen once from SIMULATE: the host's NVML and kubelet, or the
simulated node a profile names."""

from __future__ import annotations

from gpuid_agent.runtime.config import Settings
from gpuid_agent.simulate.node import SimulatedNode, SimulationConfig
from gpuid_agent.sources.host import HostConfig, HostNode, NodeEnvironment
from gpuid_agent.sources.nvml.api import NvmlApi


def node_environment(settings: Settings, nvml_api: NvmlApi | None = None) -> NodeEnvironment:
    """The host, or the simulated node SIMULATE names; `nvml_api` replaces either's NVML."""
    node = settings.effective_node_name()
    if settings.simulate:
        explicit = settings.model_fields_set
        return SimulatedNode(
            SimulationConfig(
                profile=settings.simulate,
                node=node,
                faults=tuple(settings.fault),
                pod_resources_socket=settings.pod_resources_socket
                if "pod_resources_socket" in explicit
                else None,
                process_attribution=settings.process_attribution,
                process_attribution_set="process_attribution" in explicit,
                host_proc=settings.host_proc,
            ),
            nvml_api,
        )
    return HostNode(
        HostConfig(
            node=node,
            nvml_library_path=settings.nvml_library_path,
            pod_resources_socket=settings.pod_resources_socket,
            process_attribution=settings.process_attribution,
            host_proc=settings.host_proc,
            dmi_product_uuid_path=settings.dmi_product_uuid_path,
            machine_id_path=settings.machine_id_path,
        ),
        nvml_api,
    )
