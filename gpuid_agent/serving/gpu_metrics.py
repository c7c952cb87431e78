"""/gpu/metrics families of one snapshot, and their exposition (renderer.py decides when).

The field and label tables are in metrics_fields.py, the health families in
health_families.py. A scrape only hands out bytes rendered from a snapshot; it never calls
NVML, the kubelet or the API.
Two namings: Prometheus conventions (default) and dcgm-exporter's field and label names, so
existing dashboards keep working.

Pods (see docs/attribution.md): `gpuid_gpu_allocation_info` has one series per container
holding a GPU or MIG device (namespace, pod, container, …; through a device plugin or a DRA
claim, whose name `gpuid_gpu_claim_info` adds), joined to the telemetry on
(uuid, gpu_instance_id); a GPU time-shared by three pods has three. Telemetry stays one series
per device, so its size does not grow with the pods. dcgm naming keeps dcgm-exporter's layout
instead, which its dashboards select on: every telemetry series repeated per holder with pod,
namespace and container labels (empty for a GPU nobody holds). MIG devices get their own
series (GPU_I_ID, GPU_I_PROFILE) with their own holders; the parent GPU's series carry no pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.serving.accounting_families import build_accounting_families
from gpuid_agent.serving.claim_families import build_claim_family
from gpuid_agent.serving.exposition import Family, encodable, write_openmetrics, write_text
from gpuid_agent.serving.health_families import build_health_families
from gpuid_agent.serving.metrics_fields import (
    ALLOCATION_INFO,
    FIELDS,
    HOLDER_LABELS,
    HOLDERS_METRIC,
    JOIN_LABELS,
    LABELS,
    MIB,
    MIG_LABELS,
    WORKLOAD_LABELS,
    FieldSpec,
    Naming,
    RenderOptions,
    health_metric_names,
    label_values,
    metric_names,
    pod_label_columns,
    pod_label_name,
)
from gpuid_agent.serving.share_families import build_share_families
from gpuid_agent.state.accounting_split import NO_ACCOUNTING, AccountingView
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.attribution.shares import PROCESSES_OFF, ProcessView
from gpuid_agent.state.health.verdicts import NodeHealth

# The tables live in metrics_fields; callers keep reading them from here.
__all__ = [
    "ALLOCATION_INFO",
    "FIELDS",
    "HOLDERS_METRIC",
    "HOLDER_LABELS",
    "JOIN_LABELS",
    "LABELS",
    "MIB",
    "MIG_LABELS",
    "WORKLOAD_LABELS",
    "Family",
    "FieldSpec",
    "Format",
    "Naming",
    "RenderOptions",
    "build_families",
    "build_health_families",
    "collect",
    "expose",
    "health_metric_names",
    "metric_names",
    "pod_label_columns",
    "pod_label_name",
]


def _holder_values(holder: Holder | None, options: RenderOptions) -> list[str]:
    width = len(HOLDER_LABELS) + (len(WORKLOAD_LABELS) if options.workload_labels else 0)
    if holder is None:
        return [""] * (width + len(options.pod_labels))
    values = [holder.namespace, holder.pod, holder.container]
    if options.workload_labels:
        values += [holder.workload_kind, holder.workload_name]
    labels = dict(holder.labels)
    values += [labels.get(key, "") for key, _ in options.pod_labels]
    return [encodable(v) for v in values]


def _family(spec: FieldSpec, dcgm: bool, labels: list[str]) -> Family:
    counter = spec.dcgm_counter if dcgm else spec.counter
    name = spec.dcgm_name if dcgm else spec.prom_name
    return Family(name, spec.help, "counter" if counter else "gauge", labels, bare=dcgm and counter)


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
) -> list[Family]:
    dcgm = naming == "dcgm"
    per_holder = dcgm  # dcgm-exporter's layout: pod labels on every telemetry series
    options = options or RenderOptions()
    attribution = attribution or Attribution("unavailable")

    def names(table: Iterable[tuple[str, str]], ours: bool = False) -> list[str]:
        """Label names: dcgm-exporter's on DCGM_* families, snake_case on gpuid_* ones."""
        return [d if dcgm and not ours else p for p, d in table]

    identity_names, mig_names = names(LABELS), names(MIG_LABELS)
    holder_names = names(HOLDER_LABELS)
    if options.workload_labels:
        holder_names += names(WORKLOAD_LABELS)
    holder_names += [name for _, name in options.pod_labels]
    series_names = identity_names + mig_names + (holder_names if per_holder else [])
    our_mig_names = names(MIG_LABELS, ours=True)
    info_name = "DCGM_FI_DEV_INFO" if dcgm else "gpuid_gpu_info"
    extra = ["chassis", "module_id", "driver_version"]
    info = Family(info_name, "GPU identity (value 1).", "gauge", identity_names + extra)
    holders_family = Family(
        HOLDERS_METRIC,
        "Containers holding the GPU or MIG device (time-slicing/MPS: more than one).",
        "gauge",
        names(LABELS, ours=True) + our_mig_names,
    )
    join_names = names(JOIN_LABELS, ours=True)
    allocation_info = Family(
        ALLOCATION_INFO,
        "One series (value 1) per container holding a GPU or MIG device; join on "
        "uuid and gpu_instance_id.",
        "gauge",
        join_names + our_mig_names + holder_names,
    )
    by_field = {f.key: _family(f, dcgm, series_names) for f in FIELDS}
    empty_holder = _holder_values(None, options) if per_holder else []
    for gpu in inventory.gpus:
        values = label_values(inventory, gpu)
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
            # tuples, shared by every field's row: the writer formats each label set once
            if per_holder and held:
                series = [(*values, *mig_values, *h) for h in held]
            else:
                series = [(*values, *mig_values, *empty_holder)]
            for spec in FIELDS:
                value = sample.values.get(spec.key)
                if value is None:
                    continue
                scaled = value * (spec.dcgm_scale if dcgm else spec.prom_scale)
                by_field[spec.key].add_metrics(series, scaled)
    telemetry = [f for f in by_field.values() if f.rows]
    return [info, holders_family, allocation_info, *telemetry]


Format = Literal["text", "openmetrics"]


def collect(
    inventory: NodeInventory,
    samples: Mapping[str, GpuSample],
    naming: Naming,
    health: NodeHealth | None = None,
    *,
    attribution: Attribution | None = None,
    options: RenderOptions | None = None,
    processes: ProcessView = PROCESSES_OFF,
    accounting: AccountingView = NO_ACCOUNTING,
) -> list[Family]:
    """Every /gpu/metrics family of one collection, ready for either exposition format."""
    families = build_families(inventory, samples, naming, attribution, options)
    families += build_share_families(
        inventory,
        samples,
        naming,
        attribution or Attribution("unavailable"),
        processes=processes,
        options=options or RenderOptions(),
    )
    families.append(build_claim_family(inventory, attribution, naming))
    families += build_accounting_families(accounting, naming, options or RenderOptions())
    if health is not None:
        families.extend(build_health_families(inventory, health, naming))
    return families


def expose(families: list[Family], fmt: Format) -> bytes:
    return write_text(families) if fmt == "text" else write_openmetrics(families)
