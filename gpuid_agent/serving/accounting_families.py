"""/gpu/metrics counters of GPU accounting: GPU-seconds and energy per workload (and per pod
with ACCOUNTING_PER_POD), from the snapshot's `AccountingView` (state/accounting.py).

Series are per workload (namespace, top owner, DRA claim, allow-listed pod labels), not per
pod, so they outlive pod restarts and stay few. The idle row (`namespace=""`, empty owner)
holds what no pod held, so over a node `gpuid_workload_gpu_seconds_total` grows by one per
second per GPU and the energy counter by the GPUs' own energy. Names and labels are the same
under both namings (our own families). See docs/accounting.md.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuid_agent.serving.exposition import Family, encodable
from gpuid_agent.serving.metrics_fields import (
    ACCOUNTING_METRICS,
    POD_ACCOUNTING_METRICS,
    Naming,
    RenderOptions,
)
from gpuid_agent.state.accounting_split import AccountingView, Usage, WorkloadKey

WORKLOAD_LABELS = ("namespace", "owner_kind", "owner_name", "claim")


def _values(key: WorkloadKey, options: RenderOptions) -> list[str]:
    labels = dict(key.labels)
    values = [key.namespace, key.owner_kind, key.owner_name, key.claim]
    values += [labels.get(k, "") for k, _ in options.pod_labels]
    return [encodable(v) for v in values]


def _counter(name: str, text: str, labels: list[str]) -> Family:
    return Family(name, text, "counter", labels)


def build_accounting_families(
    accounting: AccountingView, naming: Naming, options: RenderOptions
) -> list[Family]:
    del naming  # gpuid_* families: the same names and labels under either naming
    labels = [*WORKLOAD_LABELS, *(name for _, name in options.pod_labels)]
    seconds_name, device_name, energy_name = ACCOUNTING_METRICS
    seconds = _counter(
        seconds_name,
        "GPU-seconds held by a workload, share-weighted (a shared GPU split among its holders, "
        'a MIG device its fraction of the GPU); namespace="" is idle time.',
        labels,
    )
    device = _counter(
        device_name,
        "Device-seconds held by a workload: a GPU or MIG device held alone adds 1 per second.",
        labels,
    )
    energy = _counter(
        energy_name,
        "GPU energy used by a workload, the GPU's energy counter split as its GPU-seconds; "
        'namespace="" is idle energy.',
        labels,
    )
    _add(accounting.workloads, options, seconds, device, energy)
    families: list[Family] = [seconds, device, energy]
    if accounting.pods:
        pod_seconds_name, pod_energy_name = POD_ACCOUNTING_METRICS
        pod_labels = [*labels, "pod"]
        pod_seconds = _counter(pod_seconds_name, "GPU-seconds held by a pod.", pod_labels)
        pod_energy = _counter(pod_energy_name, "GPU energy used by a pod.", pod_labels)
        _add(accounting.pods, options, pod_seconds, None, pod_energy, with_pod=True)
        families += [pod_seconds, pod_energy]
    return [f for f in families if f.rows]


def _add(
    totals: Mapping[WorkloadKey, Usage],
    options: RenderOptions,
    seconds: Family,
    device: Family | None,
    energy: Family,
    *,
    with_pod: bool = False,
) -> None:
    for key in sorted(totals):
        usage = totals[key]
        values = _values(key, options)
        if with_pod:
            values.append(encodable(key.pod))
        seconds.add_metric(values, usage.gpu_seconds)
        if device is not None and key.namespace:
            device.add_metric(values, usage.device_seconds)
        if usage.energy_joules is not None:
            energy.add_metric(values, usage.energy_joules)
