"""The node inventory: sources merged into one immutable snapshot, and the diff of two."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Literal

from gpuid_agent.facts import GpuIdentity, NodeInventory

ChangeKind = Literal["added", "removed", "changed", "node"]
_NODE_FIELDS = ("node", "cluster", "machine", "driver_version")
_GPU_FIELDS = tuple(f.name for f in fields(GpuIdentity))


@dataclass(frozen=True, slots=True)
class Change:
    kind: ChangeKind
    uuid: str | None = None
    before: GpuIdentity | None = None
    after: GpuIdentity | None = None
    fields: tuple[str, ...] = ()


def build_inventory(
    gpus: Iterable[GpuIdentity],
    *,
    node: str,
    cluster: str,
    machine: str,
    machine_source: str,
    driver_version: str | None,
    cuda_driver_version: str | None,
    read_time: datetime,
) -> NodeInventory:
    return NodeInventory(
        node=node,
        cluster=cluster,
        machine=machine,
        machine_source=machine_source,
        driver_version=driver_version,
        cuda_driver_version=cuda_driver_version,
        gpus=tuple(sorted(gpus, key=lambda g: g.index)),
        read_time=read_time,
    )


def diff(old: NodeInventory | None, new: NodeInventory) -> list[Change]:
    """What changed from `old` to `new`; GPUs are matched by UUID. read_time is ignored."""
    if old is None:
        return [Change("added", g.uuid, None, g) for g in new.gpus]
    changes: list[Change] = []
    node_fields = tuple(f for f in _NODE_FIELDS if getattr(old, f) != getattr(new, f))
    if node_fields:
        changes.append(Change("node", fields=node_fields))
    before = old.gpu_by_uuid()
    after = new.gpu_by_uuid()
    for uuid, gpu in after.items():
        prev = before.get(uuid)
        if prev is None:
            changes.append(Change("added", uuid, None, gpu))
        elif prev != gpu:
            changed = tuple(f for f in _GPU_FIELDS if getattr(prev, f) != getattr(gpu, f))
            changes.append(Change("changed", uuid, prev, gpu, changed))
    changes.extend(
        Change("removed", uuid, gpu, None) for uuid, gpu in before.items() if uuid not in after
    )
    return changes


def shared_uuids(gpus: Iterable[GpuIdentity]) -> dict[str, tuple[int, ...]]:
    """UUIDs NVML reports for more than one GPU (a driver or firmware fault), with the
    indexes of the GPUs reporting each: a UUID is then no GPU's identity."""
    by_uuid: dict[str, list[int]] = {}
    for gpu in gpus:
        by_uuid.setdefault(gpu.uuid.lower(), []).append(gpu.index)
    return {uuid: tuple(sorted(i)) for uuid, i in by_uuid.items() if len(i) > 1}
