"""/gpu/metrics families of who uses each device: per-holder shares from the processes
running on it, the unattributed rest by reason, and each device's allocation state.

For one device, `gpuid_gpu_holder_memory_used_bytes` summed over holders plus
`gpuid_gpu_unattributed_memory_used_bytes` summed over reasons is the device's
`gpuid_gpu_memory_used_bytes` (SM utilization likewise adds up to the device's utilization);
see docs/attribution.md. `gpuid_gpu_allocation_state` is there for every device whether or
not process attribution is on, so "idle but allocated" and "busy but unowned" can be alerted
on. The metric names are the same under both namings; the label names follow the naming.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.serving.exposition import Family
from gpuid_agent.serving.metrics_fields import (
    ALLOCATION_STATE,
    HOLDER_LABELS,
    HOLDER_MEMORY,
    HOLDER_PROCESSES,
    HOLDER_SM,
    JOIN_LABELS,
    MIG_LABELS,
    UNATTRIBUTED_MEMORY,
    UNATTRIBUTED_PROCESSES,
    UNATTRIBUTED_SM,
    WORKLOAD_LABELS,
    Naming,
    RenderOptions,
)
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.attribution.shares import (
    USAGE_STATES,
    DeviceShares,
    ProcessView,
    usage_state,
)


def devices(gpu: GpuIdentity) -> Iterator[tuple[str, list[str]]]:
    """(device UUID, MIG label values) of each device that can be held: the GPU itself, or
    its MIG devices (a MIG GPU is not itself held)."""
    if not gpu.mig_devices:
        yield gpu.uuid, ["", ""]
        return
    for mig in gpu.mig_devices:
        gi = "" if mig.gpu_instance_id is None else str(mig.gpu_instance_id)
        yield mig.uuid, [gi, mig.profile or ""]


def _holder_values(holder: Holder, options: RenderOptions) -> list[str]:
    values = [holder.namespace, holder.pod, holder.container]
    if options.workload_labels:
        values += [holder.workload_kind, holder.workload_name]
    labels = dict(holder.labels)
    values += [labels.get(key, "") for key, _ in options.pod_labels]
    return [v.encode("utf-8", "replace").decode("utf-8") for v in values]


def build_share_families(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    naming: Naming,
    attribution: Attribution,
    *,
    processes: ProcessView,
    options: RenderOptions,
) -> list[Family]:
    dcgm = naming == "dcgm"

    def names(table: tuple[tuple[str, str], ...]) -> list[str]:
        return [d if dcgm else p for p, d in table]

    device_names = names(JOIN_LABELS) + names(MIG_LABELS)
    holder_names = names(HOLDER_LABELS)
    if options.workload_labels:
        holder_names += names(WORKLOAD_LABELS)
    holder_names += [name for _, name in options.pod_labels]
    holder_labels = [*device_names, *holder_names, "allocated"]
    reason_labels = [*device_names, "reason"]

    def gauge(name: str, text: str, labels: list[str]) -> Family:
        return Family(name, text, "gauge", labels)

    state = gauge(
        ALLOCATION_STATE,
        "Per device, 1 for its state: held_busy, held_idle (allocated, nothing runs), "
        "unowned_busy (runs, no pod holds it), free; held / unowned when its use is unknown.",
        [*device_names, "state"],
    )
    fam: dict[str, Family] = {
        HOLDER_MEMORY: gauge(
            HOLDER_MEMORY, "GPU memory used by a holder's processes.", holder_labels
        ),
        HOLDER_SM: gauge(HOLDER_SM, "SM utilization of a holder's processes.", holder_labels),
        HOLDER_PROCESSES: gauge(
            HOLDER_PROCESSES, "A holder's processes on the device.", holder_labels
        ),
        UNATTRIBUTED_MEMORY: gauge(
            UNATTRIBUTED_MEMORY,
            "GPU memory used that no pod accounts for, by reason.",
            reason_labels,
        ),
        UNATTRIBUTED_SM: gauge(
            UNATTRIBUTED_SM, "SM utilization no pod accounts for, by reason.", reason_labels
        ),
        UNATTRIBUTED_PROCESSES: gauge(
            UNATTRIBUTED_PROCESSES, "Processes not attributed to a pod, by reason.", reason_labels
        ),
    }
    for gpu in inventory.gpus:
        join = [gpu.uuid, str(gpu.index), inventory.node]
        for uuid, mig_values in devices(gpu):
            device_values = [*join, *mig_values]
            shares = processes.device(uuid)
            sample = samples.get(uuid)
            util = sample.values.get("gpu_util") if sample is not None else None
            current = usage_state(bool(attribution.holders(uuid)), util, shares)
            for s in USAGE_STATES:
                state.add_metric([*device_values, s], 1 if s == current else 0)
            if shares is not None:
                _add_shares(fam, device_values, shares, options)
    return [state, *(f for f in fam.values() if f.rows)]


def _add_shares(
    fam: dict[str, Family],
    device_values: list[str],
    shares: DeviceShares,
    options: RenderOptions,
) -> None:
    for share in shares.shares:
        if share.holder is not None:
            labels = [
                *device_values,
                *_holder_values(share.holder, options),
                "true" if share.allocated else "false",
            ]
            memory, sm, count = HOLDER_MEMORY, HOLDER_SM, HOLDER_PROCESSES
        else:
            labels = [*device_values, share.reason]
            memory, sm, count = UNATTRIBUTED_MEMORY, UNATTRIBUTED_SM, UNATTRIBUTED_PROCESSES
        if share.memory_bytes is not None:
            fam[memory].add_metric(labels, share.memory_bytes)
        if share.sm_util is not None:
            fam[sm].add_metric(labels, share.sm_util / 100)
        fam[count].add_metric(labels, share.processes)


def usage_status(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    attribution: Attribution,
    processes: ProcessView,
) -> list[dict[str, Any]]:
    """Per device, for /status: its allocation state, holders and unattributed use."""
    rows: list[dict[str, Any]] = []
    for gpu in inventory.gpus:
        for uuid, mig_values in devices(gpu):
            shares = processes.device(uuid)
            sample = samples.get(uuid)
            util = sample.values.get("gpu_util") if sample is not None else None
            holders = attribution.holders(uuid)
            rows.append(
                {
                    "gpu": gpu.index,
                    "uuid": uuid,
                    "gpu_instance_id": mig_values[0] or None,
                    "state": usage_state(bool(holders), util, shares),
                    "holders": [f"{h.namespace}/{h.pod}/{h.container}" for h in holders],
                    "unattributed": None
                    if shares is None
                    else [
                        {
                            "reason": s.reason,
                            "processes": s.processes,
                            "memory_bytes": s.memory_bytes,
                            "sm_util_percent": s.sm_util,
                        }
                        for s in shares.unattributed
                    ],
                }
            )
    return rows
