"""Health joined to workloads: which pods, containers and workloads held a GPU.

A GPU's holders are those of the GPU itself and of each of its MIG devices, from the
attribution of the same snapshot (an XID the driver raised on one MIG device names only that
device's holders), so a transition names who was on the GPU at that moment
("which jobs did XID 79 on GPU 3 hit"). Node-level checks name nobody.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from gpuid_agent.facts import NodeInventory
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.health.verdicts import NodeHealth, Transition


def gpu_holders(
    attribution: Attribution,
    inventory: NodeInventory,
    uuid: str,
    mig_instance: tuple[int, int | None] | None = None,
) -> tuple[Holder, ...]:
    """The distinct holders of GPU `uuid` and its MIG devices, in a stable order; with
    `mig_instance` (GPU instance, compute instance or None) only those of that MIG device."""
    gpu = inventory.gpu_by_uuid().get(uuid)
    devices = [uuid, *(m.uuid for m in gpu.mig_devices)] if gpu is not None else [uuid]
    if mig_instance is not None and gpu is not None:
        gi, ci = mig_instance
        devices = [
            m.uuid
            for m in gpu.mig_devices
            if m.gpu_instance_id == gi and (ci is None or m.compute_instance_id in (ci, None))
        ]
    seen: dict[Holder, None] = {}
    for device in devices:
        for holder in attribution.holders(device):
            seen.setdefault(holder, None)
    return tuple(sorted(seen, key=lambda h: (h.namespace, h.pod, h.container)))


def with_holders(
    transitions: Iterable[Transition], inventory: NodeInventory, attribution: Attribution
) -> tuple[Transition, ...]:
    return tuple(
        dataclasses.replace(t, holders=gpu_holders(attribution, inventory, t.uuid, t.mig_instance))
        if t.uuid is not None
        else t
        for t in transitions
    )


def holder_dict(holder: Holder) -> dict[str, str]:
    """A holder as records and /status show it; what the API did not add is left out."""
    out = {"namespace": holder.namespace, "pod": holder.pod, "container": holder.container}
    extra = {
        "pod_uid": holder.pod_uid,
        "workload_kind": holder.workload_kind,
        "workload_name": holder.workload_name,
    }
    out.update((k, v) for k, v in extra.items() if v)
    return out


def health_status(
    health: NodeHealth, inventory: NodeInventory | None, attribution: Attribution
) -> dict[str, Any]:
    """The /status health document, each GPU that is not healthy with its holders."""
    doc = health.as_dict()
    if inventory is None:
        return doc
    for gpu in doc["gpus"]:
        if gpu["state"] in ("degraded", "unhealthy"):
            holders = gpu_holders(attribution, inventory, gpu["uuid"])
            gpu["holders"] = [holder_dict(h) for h in holders]
    return doc
