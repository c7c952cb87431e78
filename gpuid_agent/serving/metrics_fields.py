"""What /gpu/metrics exposes: field and label tables under both namings, and metric names.

Sample keys (from the NVML source) map to Prometheus names in base units and to
dcgm-exporter's names and units, so existing dcgm dashboards keep working.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gpuid_agent.facts import GpuIdentity, NodeInventory

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
    # Prometheus naming exposes a counter (prom_name ends in _total).
    counter: bool = False
    # dcgm naming types it a counter as dcgm-exporter's counter file does, under the bare
    # dcgm name (no _total: the text format allows that, and dcgm-exporter serves only it).
    dcgm_counter: bool = False


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
        dcgm_counter=True,
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
        dcgm_counter=True,
    ),
    FieldSpec(
        "ecc_sbe_volatile",
        "gpuid_gpu_ecc_corrected_volatile_errors_total",
        1,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        1,
        "Corrected ECC errors since the driver loaded.",
        counter=True,
        dcgm_counter=True,
    ),
    FieldSpec(
        "ecc_dbe_volatile",
        "gpuid_gpu_ecc_uncorrected_volatile_errors_total",
        1,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        1,
        "Uncorrected ECC errors since the driver loaded.",
        counter=True,
        dcgm_counter=True,
    ),
    FieldSpec(
        "ecc_sbe_aggregate",
        "gpuid_gpu_ecc_corrected_aggregate_errors_total",
        1,
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        1,
        "Corrected ECC errors over the GPU's life.",
        counter=True,
        dcgm_counter=True,
    ),
    FieldSpec(
        "ecc_dbe_aggregate",
        "gpuid_gpu_ecc_uncorrected_aggregate_errors_total",
        1,
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        1,
        "Uncorrected ECC errors over the GPU's life.",
        counter=True,
        dcgm_counter=True,
    ),
    FieldSpec(
        "remapped_rows_correctable",
        "gpuid_gpu_remapped_rows_correctable",
        1,
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        1,
        "Rows remapped for correctable errors.",
        dcgm_counter=True,
    ),
    FieldSpec(
        "remapped_rows_uncorrectable",
        "gpuid_gpu_remapped_rows_uncorrectable",
        1,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        1,
        "Rows remapped for uncorrectable errors.",
        dcgm_counter=True,
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
    FieldSpec(
        "pcie_link_gen",
        "gpuid_gpu_pcie_link_generation",
        1,
        "DCGM_FI_DEV_PCIE_LINK_GEN",
        1,
        "PCIe link generation as trained now (idle links drop it to save power).",
    ),
    FieldSpec(
        "pcie_link_max_gen",
        "gpuid_gpu_pcie_link_max_generation",
        1,
        "DCGM_FI_DEV_PCIE_MAX_LINK_GEN",
        1,
        "Highest PCIe link generation the GPU and its slot support together.",
    ),
    FieldSpec(
        "pcie_link_width",
        "gpuid_gpu_pcie_link_width",
        1,
        "DCGM_FI_DEV_PCIE_LINK_WIDTH",
        1,
        "PCIe lanes as trained now.",
    ),
    FieldSpec(
        "pcie_link_max_width",
        "gpuid_gpu_pcie_link_max_width",
        1,
        "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH",
        1,
        "Widest PCIe link the GPU and its slot support.",
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
# who uses each device (share_families.py): same names under both namings
ALLOCATION_STATE = "gpuid_gpu_allocation_state"
HOLDER_MEMORY = "gpuid_gpu_holder_memory_used_bytes"
HOLDER_SM = "gpuid_gpu_holder_sm_utilization_ratio"
HOLDER_PROCESSES = "gpuid_gpu_holder_processes"
UNATTRIBUTED_MEMORY = "gpuid_gpu_unattributed_memory_used_bytes"
UNATTRIBUTED_SM = "gpuid_gpu_unattributed_sm_utilization_ratio"
UNATTRIBUTED_PROCESSES = "gpuid_gpu_unattributed_processes"
SHARE_METRICS = (
    ALLOCATION_STATE,
    HOLDER_MEMORY,
    HOLDER_SM,
    HOLDER_PROCESSES,
    UNATTRIBUTED_MEMORY,
    UNATTRIBUTED_SM,
    UNATTRIBUTED_PROCESSES,
)
CLAIM_INFO = "gpuid_gpu_claim_info"
# DRA labels of gpuid_gpu_claim_info (same in both namings), after the join, MIG and holder ones
CLAIM_LABELS = ("claim_namespace", "claim_name", "dra_pool", "dra_device", "source")
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
    return [
        info,
        HOLDERS_METRIC,
        ALLOCATION_INFO,
        CLAIM_INFO,
        *names,
        *health_metric_names(naming),
        *SHARE_METRICS,
    ]


def label_values(inventory: NodeInventory, gpu: GpuIdentity) -> list[str]:
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


HEALTH_STATE = "gpuid_gpu_health_state"
NODE_HEALTH_STATE = "gpuid_node_health_state"
XID_ERRORS = "gpuid_gpu_xid_errors"  # exposed as gpuid_gpu_xid_errors_total
DCGM_XID = "DCGM_FI_DEV_XID_ERRORS"
NVLINK_UP = "gpuid_gpu_nvlink_up"
NVLINK_ERRORS = "gpuid_gpu_nvlink_errors"  # exposed as gpuid_gpu_nvlink_errors_total
PCIE_AER_ERRORS = "gpuid_gpu_pcie_aer_errors"  # exposed as gpuid_gpu_pcie_aer_errors_total


def health_metric_names(naming: Naming) -> list[str]:
    names = [
        HEALTH_STATE,
        NODE_HEALTH_STATE,
        f"{XID_ERRORS}_total",
        NVLINK_UP,
        f"{NVLINK_ERRORS}_total",
        f"{PCIE_AER_ERRORS}_total",
    ]
    return [*names, DCGM_XID] if naming == "dcgm" else names
