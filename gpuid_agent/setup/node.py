"""Settings turned into the small configs of the node's components: the collector and its
health checks, attribution, the Node labeller and /status. Each component reads only its own."""

from __future__ import annotations

from gpuid_agent.node.labels.service import LabellingConfig
from gpuid_agent.runtime.config import Settings
from gpuid_agent.serving.status_page import StatusConfig
from gpuid_agent.sources.host import NodeEnvironment
from gpuid_agent.state.accounting import AccountingConfig
from gpuid_agent.state.attribution.service import AttributionConfig
from gpuid_agent.state.collector import CollectorConfig
from gpuid_agent.state.health.monitor import HealthConfig
from gpuid_agent.state.state_file import StateDir


def collector_config(settings: Settings, state_dir: StateDir) -> CollectorConfig:
    return CollectorConfig(
        interval=settings.collect_interval,
        health=HealthConfig(
            window=settings.health_window,
            xid_hold=settings.xid_hold,
            pcie_replay_threshold=settings.pcie_replay_threshold,
            xid_repeat_count=settings.xid_repeat_count,
            xid_repeat_window=settings.xid_repeat_window,
            expected_gpu_count=settings.expected_gpu_count,
            collect_interval=settings.collect_interval,
            state_dir=state_dir,
            host_proc=settings.host_proc,
            kernel_log=settings.kernel_log,
        ),
        accounting=AccountingConfig(
            settings.accounting_per_pod, state_dir, retention=settings.accounting_retention
        ),
    )


def attribution_config(settings: Settings) -> AttributionConfig:
    return AttributionConfig(
        node=settings.effective_node_name(),
        pod_resources_timeout=settings.pod_resources_timeout,
        pod_resources_interval=settings.pod_resources_interval,
        pod_resources_stale_after=settings.pod_resources_stale_after,
        gpu_resource_names=tuple(settings.gpu_resource_names),
        pod_label_allowlist=tuple(settings.pod_label_allowlist),
        kube_api=settings.kube_api,
        dra_resource_slices=settings.dra_resource_slices,
    )


def labelling_config(settings: Settings) -> LabellingConfig:
    return LabellingConfig(
        mode=settings.labels,
        prefix=settings.label_prefix,
        annotation=settings.label_annotation,
        resync_interval=settings.label_resync_interval,
        startup_jitter=settings.label_startup_jitter,
        debounce=min(1.0, settings.collect_interval),
        kube_api_off=settings.kube_api == "off",
    )


def status_config(settings: Settings, environment: NodeEnvironment) -> StatusConfig:
    """/status's config section, and the /proc it names: the environment's, which a simulated
    node with processes replaces by its own."""
    return StatusConfig(
        settings=settings.redacted(),
        host_proc=environment.host_proc if environment.process_attribution else None,
    )
