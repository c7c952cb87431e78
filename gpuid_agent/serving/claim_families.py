"""`gpuid_gpu_claim_info`: which container holds which GPU or MIG device through which DRA
claim (one series, value 1, per container, claim and device), and whether the device was
joined through the node's ResourceSlices (`source="dra"`) or node-locally from its name
(`source="dra-fallback"`, full GPUs only). Joins the telemetry on (uuid, gpu_instance_id)
like `gpuid_gpu_allocation_info`, which lists DRA holders too."""

from __future__ import annotations

from gpuid_agent.facts import NodeInventory
from gpuid_agent.serving.exposition import Family, encodable
from gpuid_agent.serving.metrics_fields import (
    CLAIM_INFO,
    CLAIM_LABELS,
    HOLDER_LABELS,
    JOIN_LABELS,
    MIG_LABELS,
    Naming,
)
from gpuid_agent.state.attribution.holders import Attribution


def build_claim_family(
    inventory: NodeInventory, attribution: Attribution | None, naming: Naming
) -> Family:
    del naming  # a gpuid_* family: snake_case labels under either naming
    names = [p for p, _ in (*JOIN_LABELS, *MIG_LABELS, *HOLDER_LABELS)]
    family = Family(
        CLAIM_INFO,
        "One series (value 1) per container holding a GPU or MIG device through a DRA claim; "
        "source is dra (ResourceSlices) or dra-fallback (node-local, full GPUs).",
        "gauge",
        names + list(CLAIM_LABELS),
    )
    if attribution is None:
        return family
    gpus = inventory.gpu_by_uuid()
    seen: set[tuple[str, ...]] = set()
    for a in attribution.allocations:
        claim = a.claim
        gpu = gpus.get(a.gpu_uuid)
        if claim is None or gpu is None:
            continue
        mig = next((m for m in gpu.mig_devices if m.uuid == a.mig_uuid), None)
        gi = "" if mig is None or mig.gpu_instance_id is None else str(mig.gpu_instance_id)
        h = a.holder
        pool, _, device = a.device_id.partition("/")
        values = (
            gpu.uuid,
            str(gpu.index),
            inventory.node,
            gi,
            (mig.profile or "") if mig is not None else "",
            h.namespace,
            h.pod,
            h.container,
            claim.namespace,
            claim.name,
            pool,
            device,
            claim.source,
        )
        if values not in seen:  # a shared device's shares: one series per claim and device
            seen.add(values)
            family.add_metric([encodable(v) for v in values], 1)
    return family
