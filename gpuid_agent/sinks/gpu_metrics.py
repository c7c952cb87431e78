"""/gpu/metrics: per-GPU telemetry rendered once per collection into cached bytes.

A scrape only hands out the last rendered bytes; it never calls NVML, the kubelet or the API.
Two namings: Prometheus conventions (default) and dcgm-exporter's field and label names, so
existing dashboards keep working.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from gpuid_agent.health.model import NodeHealth
from gpuid_agent.model import GpuIdentity, GpuSample, NodeInventory

Naming = Literal["prometheus", "dcgm"]
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class FieldSpec:
    key: str
    prom_name: str
    prom_scale: float
    dcgm_name: str
    dcgm_scale: float
    help: str


# Sample keys (from the NVML source) → exposed names. Prometheus naming uses base units
# (bytes, ratios, watts); dcgm naming keeps dcgm-exporter's units (MiB, percent).
FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "gpu_util",
        "gpuid_gpu_utilization_ratio",
        0.01,
        "DCGM_FI_DEV_GPU_UTIL",
        1,
        "GPU utilization.",
    ),
    FieldSpec(
        "mem_copy_util",
        "gpuid_gpu_memory_copy_utilization_ratio",
        0.01,
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        1,
        "Memory copy utilization.",
    ),
    FieldSpec(
        "memory_used_bytes",
        "gpuid_gpu_memory_used_bytes",
        1,
        "DCGM_FI_DEV_FB_USED",
        1 / MIB,
        "Framebuffer memory used.",
    ),
    FieldSpec(
        "memory_free_bytes",
        "gpuid_gpu_memory_free_bytes",
        1,
        "DCGM_FI_DEV_FB_FREE",
        1 / MIB,
        "Framebuffer memory free.",
    ),
    FieldSpec(
        "memory_total_bytes",
        "gpuid_gpu_memory_total_bytes",
        1,
        "DCGM_FI_DEV_FB_TOTAL",
        1 / MIB,
        "Framebuffer memory total.",
    ),
    FieldSpec(
        "temperature_celsius",
        "gpuid_gpu_temperature_celsius",
        1,
        "DCGM_FI_DEV_GPU_TEMP",
        1,
        "GPU temperature.",
    ),
    FieldSpec(
        "power_watts", "gpuid_gpu_power_watts", 1, "DCGM_FI_DEV_POWER_USAGE", 1, "Power draw."
    ),
)

# Identity labels: (prometheus name, dcgm name)
LABELS: tuple[tuple[str, str], ...] = (
    ("gpu", "gpu"),
    ("uuid", "UUID"),
    ("pci_bus_id", "pci_bus_id"),
    ("device", "device"),
    ("model_name", "modelName"),
    ("hostname", "Hostname"),
    ("serial", "serial"),
)


def metric_names(naming: Naming) -> list[str]:
    """Every metric family /gpu/metrics can expose under a naming."""
    info = "gpuid_gpu_info" if naming == "prometheus" else "DCGM_FI_DEV_INFO"
    names = [f.prom_name if naming == "prometheus" else f.dcgm_name for f in FIELDS]
    return [info, *names]


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def build_families(
    inventory: NodeInventory, samples: Mapping[str, GpuSample], naming: Naming
) -> list[Metric]:
    dcgm = naming == "dcgm"
    label_names = [d if dcgm else p for p, d in LABELS]
    info_name = "DCGM_FI_DEV_INFO" if dcgm else "gpuid_gpu_info"
    extra = ["chassis", "module_id", "driver_version"]
    info = GaugeMetricFamily(info_name, "GPU identity (value 1).", labels=label_names + extra)
    by_field = {
        f.key: GaugeMetricFamily(f.dcgm_name if dcgm else f.prom_name, f.help, labels=label_names)
        for f in FIELDS
    }
    for gpu in inventory.gpus:
        values = _label_values(inventory, gpu)
        info.add_metric(
            [
                *values,
                gpu.chassis_serial or "",
                str(gpu.module_id or ""),
                inventory.driver_version or "",
            ],
            1,
        )
        sample = samples.get(gpu.uuid)
        if sample is None:
            continue
        for spec in FIELDS:
            value = sample.values.get(spec.key)
            if value is not None:
                scale = spec.dcgm_scale if dcgm else spec.prom_scale
                by_field[spec.key].add_metric(values, value * scale)
    return [info, *(f for f in by_field.values() if f.samples)]


@dataclass(frozen=True, slots=True)
class RenderedMetrics:
    text: bytes
    openmetrics: bytes


def render(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    naming: Naming,
    health: NodeHealth | None = None,
) -> RenderedMetrics:
    families = build_families(inventory, samples, naming)
    if health is not None:
        families.extend(build_health_families(inventory, health, naming))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return RenderedMetrics(
        text=generate_latest(registry),
        openmetrics=openmetrics.generate_latest(registry),  # type: ignore[no-untyped-call]
    )


EMPTY = RenderedMetrics(text=b"", openmetrics=b"# EOF\n")


def _label_values(inventory: NodeInventory, gpu: GpuIdentity) -> list[str]:
    """Values of LABELS for one GPU, in order."""
    return [
        str(gpu.index),
        gpu.uuid,
        gpu.pci_bus_id or "",
        gpu.device,
        gpu.name or "",
        inventory.node,
        gpu.serial or "",
    ]


# ---- health ------------------------------------------------------------------------------
# One series per GPU and check (and "overall") with value 1, labelled with its current state
# and suggested action: `gpuid_gpu_health_state{state="unhealthy"} == 1` finds every broken
# GPU. Only the current state is exposed, so a node costs one series per check, not five.
# The names are the same under both namings (dcgm-exporter has no equivalent), except that
# dcgm naming also gets DCGM_FI_DEV_XID_ERRORS: the last XID seen, as dcgm-exporter reports it.

HEALTH_STATE = "gpuid_gpu_health_state"
NODE_HEALTH_STATE = "gpuid_node_health_state"
XID_ERRORS = "gpuid_gpu_xid_errors"  # exposed as gpuid_gpu_xid_errors_total
DCGM_XID = "DCGM_FI_DEV_XID_ERRORS"


def health_metric_names(naming: Naming) -> list[str]:
    names = [HEALTH_STATE, NODE_HEALTH_STATE, f"{XID_ERRORS}_total"]
    return [*names, DCGM_XID] if naming == "dcgm" else names


def build_health_families(
    inventory: NodeInventory, health: NodeHealth, naming: Naming
) -> list[Metric]:
    dcgm = naming == "dcgm"
    label_names = [d if dcgm else p for p, d in LABELS]
    state = GaugeMetricFamily(
        HEALTH_STATE,
        "GPU health per check (and overall): 1 on the series of the current state and action.",
        labels=[*label_names, "check", "state", "action"],
    )
    xids = CounterMetricFamily(
        XID_ERRORS,
        "XID errors reported by the driver since the agent started, by code.",
        labels=[*label_names, "xid"],
    )
    last_xid = GaugeMetricFamily(DCGM_XID, "Value of the last XID error seen.", labels=label_names)
    by_uuid = inventory.gpu_by_uuid()
    for gpu_health in health.gpus:
        gpu = by_uuid.get(gpu_health.uuid)
        if gpu is None:
            continue
        values = _label_values(inventory, gpu)
        state.add_metric([*values, "overall", gpu_health.state, gpu_health.action], 1)
        for name, check in gpu_health.checks.items():
            state.add_metric([*values, name, check.state, check.action], 1)
        for code, count in sorted(gpu_health.xid_counts.items()):
            xids.add_metric([*values, str(code)], count)
        last_xid.add_metric(values, gpu_health.last_xid or 0)
    node = GaugeMetricFamily(
        NODE_HEALTH_STATE,
        "Node-level GPU health checks: 1 on the series of the current state and action.",
        labels=["hostname" if not dcgm else "Hostname", "check", "state", "action"],
    )
    for name, check in health.node_checks.items():
        node.add_metric([inventory.node, name, check.state, check.action], 1)
    families: list[Metric] = [state, node, xids]
    if dcgm:
        families.append(last_xid)
    return families
