"""/gpu/metrics: per-GPU telemetry rendered once per collection into cached bytes.

A scrape only hands out the last rendered bytes; it never calls NVML, the kubelet or the API.
Two namings: Prometheus conventions (default) and dcgm-exporter's field and label names, so
existing dashboards keep working.

Pods (see docs/attribution.md): `gpuid_gpu_allocation_info` has one series per container
holding a GPU or MIG device (namespace, pod, container, …), joined to the telemetry on
(uuid, gpu_instance_id); a GPU time-shared by three pods has three. Telemetry stays one series
per device, so its size does not grow with the pods. dcgm naming keeps dcgm-exporter's layout
instead, which its dashboards select on: every telemetry series repeated per holder with pod,
namespace and container labels (empty for a GPU nobody holds). MIG devices get their own
series (GPU_I_ID, GPU_I_PROFILE) with their own holders; the parent GPU's series carry no pod.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from gpuid_agent.model import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.state.attribution.model import Attribution, Holder
from gpuid_agent.state.health.model import NodeHealth

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
    # Prometheus naming exposes a counter (prom_name ends in _total); dcgm naming keeps the
    # bare dcgm name, so it is exposed as a gauge there (rate() works on either).
    counter: bool = False


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
    FieldSpec(
        "enc_util",
        "gpuid_gpu_encoder_utilization_ratio",
        0.01,
        "DCGM_FI_DEV_ENC_UTIL",
        1,
        "Encoder utilization.",
    ),
    FieldSpec(
        "dec_util",
        "gpuid_gpu_decoder_utilization_ratio",
        0.01,
        "DCGM_FI_DEV_DEC_UTIL",
        1,
        "Decoder utilization.",
    ),
    FieldSpec(
        "energy_mj",
        "gpuid_gpu_energy_joules_total",
        0.001,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        1,
        "Energy used since the driver loaded (dcgm naming: millijoules).",
        counter=True,
    ),
    FieldSpec(
        "sm_clock_mhz",
        "gpuid_gpu_sm_clock_hertz",
        1e6,
        "DCGM_FI_DEV_SM_CLOCK",
        1,
        "SM clock (dcgm naming: MHz).",
    ),
    FieldSpec(
        "mem_clock_mhz",
        "gpuid_gpu_memory_clock_hertz",
        1e6,
        "DCGM_FI_DEV_MEM_CLOCK",
        1,
        "Memory clock (dcgm naming: MHz).",
    ),
    FieldSpec(
        "pcie_replay",
        "gpuid_gpu_pcie_replays_total",
        1,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        1,
        "PCIe replays.",
        counter=True,
    ),
    FieldSpec(
        "ecc_sbe_volatile",
        "gpuid_gpu_ecc_corrected_volatile_errors_total",
        1,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        1,
        "Corrected ECC errors since the driver loaded.",
        counter=True,
    ),
    FieldSpec(
        "ecc_dbe_volatile",
        "gpuid_gpu_ecc_uncorrected_volatile_errors_total",
        1,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        1,
        "Uncorrected ECC errors since the driver loaded.",
        counter=True,
    ),
    FieldSpec(
        "ecc_sbe_aggregate",
        "gpuid_gpu_ecc_corrected_aggregate_errors_total",
        1,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        1,
        "Corrected ECC errors over the GPU's life.",
        counter=True,
    ),
    FieldSpec(
        "ecc_dbe_aggregate",
        "gpuid_gpu_ecc_uncorrected_aggregate_errors_total",
        1,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        1,
        "Uncorrected ECC errors over the GPU's life.",
        counter=True,
    ),
    FieldSpec(
        "remapped_rows_correctable",
        "gpuid_gpu_remapped_rows_correctable",
        1,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        1,
        "Rows remapped for correctable errors.",
    ),
    FieldSpec(
        "remapped_rows_uncorrectable",
        "gpuid_gpu_remapped_rows_uncorrectable",
        1,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        1,
        "Rows remapped for uncorrectable errors.",
    ),
    FieldSpec(
        "row_remap_pending",
        "gpuid_gpu_row_remap_pending",
        1,
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        1,
        "1 when a row remap waits for a GPU reset.",
    ),
    FieldSpec(
        "row_remap_failure",
        "gpuid_gpu_row_remap_failure",
        1,
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        1,
        "1 when a row remap failed.",
    ),
    FieldSpec(
        "clock_event_reasons",
        "gpuid_gpu_clock_event_reasons",
        1,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        1,
        "Bitmask of why clocks are held down (nvmlClocksEventReasons).",
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
MIG_LABELS: tuple[tuple[str, str], ...] = (
    ("gpu_instance_id", "GPU_I_ID"),
    ("gpu_instance_profile", "GPU_I_PROFILE"),
)
HOLDER_LABELS: tuple[tuple[str, str], ...] = (
    ("namespace", "namespace"),
    ("pod", "pod"),
    ("container", "container"),
)
WORKLOAD_LABELS: tuple[tuple[str, str], ...] = (
    ("workload_kind", "workload_kind"),
    ("workload_name", "workload_name"),
)
# the identity labels gpuid_gpu_allocation_info repeats, to join on and to read it alone
JOIN_LABELS: tuple[tuple[str, str], ...] = (
    ("uuid", "UUID"),
    ("gpu", "gpu"),
    ("hostname", "Hostname"),
)
HOLDERS_METRIC = "gpuid_gpu_holders"
ALLOCATION_INFO = "gpuid_gpu_allocation_info"
_LABEL_CHAR = re.compile(r"[^A-Za-z0-9_]")


def pod_label_name(key: str) -> str:
    """Prometheus label name for a Kubernetes pod label key (`app.kubernetes.io/name` →
    `label_app_kubernetes_io_name`, as kube-state-metrics names them)."""
    return "label_" + _LABEL_CHAR.sub("_", key)


def pod_label_columns(allowlist: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(pod label key, label name) per allowed key; a key whose name collides with an earlier
    key's is dropped rather than merged."""
    columns: dict[str, str] = {}
    for key in allowlist:
        columns.setdefault(pod_label_name(key), key)
    return tuple((key, name) for name, key in columns.items())


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What the pod part of the label set holds, fixed for the life of the agent."""

    workload_labels: bool = False
    pod_labels: tuple[tuple[str, str], ...] = ()  # from pod_label_columns()


def metric_names(naming: Naming) -> list[str]:
    """Every metric family /gpu/metrics can expose under a naming."""
    info = "gpuid_gpu_info" if naming == "prometheus" else "DCGM_FI_DEV_INFO"
    names = [f.prom_name if naming == "prometheus" else f.dcgm_name for f in FIELDS]
    return [info, HOLDERS_METRIC, ALLOCATION_INFO, *names, *health_metric_names(naming)]


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _text(value: str) -> str:
    """A label value that always encodes (API strings may carry lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _holder_values(holder: Holder | None, options: RenderOptions) -> list[str]:
    width = len(HOLDER_LABELS) + (len(WORKLOAD_LABELS) if options.workload_labels else 0)
    if holder is None:
        return [""] * (width + len(options.pod_labels))
    values = [holder.namespace, holder.pod, holder.container]
    if options.workload_labels:
        values += [holder.workload_kind, holder.workload_name]
    labels = dict(holder.labels)
    values += [labels.get(key, "") for key, _ in options.pod_labels]
    return [_text(v) for v in values]


def _family(
    spec: FieldSpec, dcgm: bool, labels: list[str]
) -> GaugeMetricFamily | CounterMetricFamily:
    if dcgm:
        return GaugeMetricFamily(spec.dcgm_name, spec.help, labels=labels)
    if spec.counter:
        return CounterMetricFamily(spec.prom_name.removesuffix("_total"), spec.help, labels=labels)
    return GaugeMetricFamily(spec.prom_name, spec.help, labels=labels)


def _rows(
    gpu: GpuIdentity, attribution: Attribution
) -> Iterator[tuple[str, list[str], tuple[Holder, ...]]]:
    """(sample UUID, MIG label values, holders) per series group of one GPU."""
    if not gpu.mig_devices:
        yield gpu.uuid, ["", ""], attribution.holders(gpu.uuid)
        return
    yield gpu.uuid, ["", ""], ()
    for mig in gpu.mig_devices:
        gi = "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id)
        yield mig.uuid, [gi, mig.profile or ""], attribution.holders(mig.uuid)


def build_families(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    naming: Naming,
    attribution: Attribution | None = None,
    options: RenderOptions | None = None,
) -> list[Metric]:
    dcgm = naming == "dcgm"
    per_holder = dcgm  # dcgm-exporter's layout: pod labels on every telemetry series
    options = options or RenderOptions()
    attribution = attribution or Attribution("unavailable")

    def names(table: Iterable[tuple[str, str]]) -> list[str]:
        return [d if dcgm else p for p, d in table]

    identity_names, mig_names = names(LABELS), names(MIG_LABELS)
    holder_names = names(HOLDER_LABELS)
    if options.workload_labels:
        holder_names += names(WORKLOAD_LABELS)
    holder_names += [name for _, name in options.pod_labels]
    series_names = identity_names + mig_names + (holder_names if per_holder else [])
    info_name = "DCGM_FI_DEV_INFO" if dcgm else "gpuid_gpu_info"
    extra = ["chassis", "module_id", "driver_version"]
    info = GaugeMetricFamily(info_name, "GPU identity (value 1).", labels=identity_names + extra)
    holders_family = GaugeMetricFamily(
        HOLDERS_METRIC,
        "Containers holding the GPU or MIG device (time-slicing/MPS: more than one).",
        labels=identity_names + mig_names,
    )
    join_names = names(JOIN_LABELS)
    allocation_info = GaugeMetricFamily(
        ALLOCATION_INFO,
        "One series (value 1) per container holding a GPU or MIG device; join on "
        "uuid and gpu_instance_id.",
        labels=join_names + mig_names + holder_names,
    )
    by_field = {f.key: _family(f, dcgm, series_names) for f in FIELDS}
    empty_holder = _holder_values(None, options) if per_holder else []
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
        for uuid, mig_values, holders in _rows(gpu, attribution):
            if uuid != gpu.uuid or not gpu.mig_devices:
                holders_family.add_metric([*values, *mig_values], len(holders))
            held = [_holder_values(h, options) for h in holders]
            for holder_values in held:
                allocation_info.add_metric(
                    [gpu.uuid, str(gpu.index), inventory.node, *mig_values, *holder_values], 1
                )
            sample = samples.get(uuid)
            if sample is None:
                continue
            if per_holder and held:
                series = [[*values, *mig_values, *h] for h in held]
            else:
                series = [[*values, *mig_values, *empty_holder]]
            for spec in FIELDS:
                value = sample.values.get(spec.key)
                if value is None:
                    continue
                scaled = value * (spec.dcgm_scale if dcgm else spec.prom_scale)
                family = by_field[spec.key]
                for labels in series:
                    family.add_metric(labels, scaled)
    telemetry = [f for f in by_field.values() if f.samples]
    return [info, holders_family, allocation_info, *telemetry]


@dataclass(frozen=True, slots=True)
class RenderedMetrics:
    text: bytes
    openmetrics: bytes


def render(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    naming: Naming,
    health: NodeHealth | None = None,
    *,
    attribution: Attribution | None = None,
    options: RenderOptions | None = None,
) -> RenderedMetrics:
    families = build_families(inventory, samples, naming, attribution, options)
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
