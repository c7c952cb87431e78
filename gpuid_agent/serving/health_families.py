"""/gpu/metrics health families.

One series per GPU and check (and "overall") with value 1, labelled with its current state
and suggested action: `gpuid_gpu_health_state{state="unhealthy"} == 1` finds every broken
GPU. Only the current state is exposed, so a node costs one series per check, not five.
Names and (snake_case) labels are the same under both namings (dcgm-exporter has no
equivalent), except that dcgm naming also gets DCGM_FI_DEV_XID_ERRORS: the last XID seen, as
dcgm-exporter reports it, with its labels.
NVLink state is per link (a `link` label) and error counters per GPU and counter, families of
their own under both namings, as are the PCIe AER counters (by severity: correctable,
non_fatal, fatal; a GPU whose driver does not report them has no series).
"""

from __future__ import annotations

from gpuid_agent.facts import NVLINK_COUNTERS, PCIE_AER_COUNTERS, NodeInventory
from gpuid_agent.serving.exposition import Family
from gpuid_agent.serving.metrics_fields import (
    DCGM_XID,
    HEALTH_STATE,
    LABELS,
    NODE_HEALTH_STATE,
    NVLINK_ERRORS,
    NVLINK_UP,
    PCIE_AER_ERRORS,
    XID_ERRORS,
    Naming,
    label_values,
)
from gpuid_agent.state.health.verdicts import NodeHealth


def build_health_families(
    inventory: NodeInventory, health: NodeHealth, naming: Naming
) -> list[Family]:
    dcgm = naming == "dcgm"
    label_names = [p for p, _ in LABELS]  # gpuid_* families: snake_case in either naming
    state = Family(
        HEALTH_STATE,
        "GPU health per check (and overall): 1 on the series of the current state and action.",
        "gauge",
        [*label_names, "check", "state", "action"],
    )
    xids = Family(
        XID_ERRORS,
        "XID errors reported by the driver since the agent started, by code.",
        "counter",
        [*label_names, "xid"],
    )
    last_xid = Family(
        DCGM_XID, "Value of the last XID error seen.", "gauge", [d for _, d in LABELS]
    )
    nvlink_up = Family(
        NVLINK_UP,
        "1 while the NVLink is active (GPUs with NVLink only).",
        "gauge",
        [*label_names, "link"],
    )
    # Summed over the GPU's links: 4 series per GPU rather than 72; the health check and
    # /status name the link whose counters grow.
    nvlink_errors = Family(
        NVLINK_ERRORS,
        "NVLink data-link errors since the driver loaded, over all links of the GPU, by "
        "counter (replay, recovery, crc_flit, crc_data).",
        "counter",
        [*label_names, "counter"],
    )
    aer = Family(
        PCIE_AER_ERRORS,
        "PCIe AER errors of the GPU's link since the driver loaded, by counter (correctable, "
        "non_fatal, fatal).",
        "counter",
        [*label_names, "counter"],
    )
    by_uuid = inventory.gpu_by_uuid()
    for gpu_health in health.gpus:
        gpu = by_uuid.get(gpu_health.uuid)
        if gpu is None:
            continue
        values = label_values(inventory, gpu)
        state.add_metric([*values, "overall", gpu_health.state, gpu_health.action], 1)
        for name, check in gpu_health.checks.items():
            state.add_metric([*values, name, check.state, check.action], 1)
        for code, count in sorted(gpu_health.xid_counts.items()):
            xids.add_metric([*values, str(code)], count)
        last_xid.add_metric(values, gpu_health.last_xid or 0)
        totals: dict[str, int] = {}
        for link in gpu_health.nvlinks:
            nvlink_up.add_metric([*values, str(link.link)], 1 if link.active else 0)
            for counter, errors in zip(NVLINK_COUNTERS, link.errors, strict=True):
                if errors is not None:
                    totals[counter] = totals.get(counter, 0) + errors
        for counter, total in totals.items():
            nvlink_errors.add_metric([*values, counter], total)
        if gpu_health.pcie_aer is not None:
            for kind, errors_seen in zip(PCIE_AER_COUNTERS, gpu_health.pcie_aer, strict=True):
                if errors_seen is not None:
                    aer.add_metric([*values, kind], errors_seen)
    node = Family(
        NODE_HEALTH_STATE,
        "Node-level GPU health checks: 1 on the series of the current state and action.",
        "gauge",
        ["hostname", "check", "state", "action"],
    )
    for name, check in health.node_checks.items():
        node.add_metric([inventory.node, name, check.state, check.action], 1)
    families: list[Family] = [state, node, xids, nvlink_up, nvlink_errors, aer]
    if dcgm:
        families.append(last_xid)
    return families
