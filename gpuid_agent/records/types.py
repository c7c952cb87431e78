"""One frozen record type per kind. Field order is the wire order; `serialize.to_wire` turns
any of them into its wire dict, the form every sink and file receives.

Reading and health ids hash what the record says, so they are computed by the serializer and
are not fields here; an allocation's id hashes (allocation_id, event) and is carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from gpuid_agent.facts import GpuIdentity, NodeInventory

SCHEMA_VERSION = 1
Kind = Literal["reading", "allocation", "health", "hardware"]


class Header(TypedDict):
    """The fields every record kind carries besides `kind` (each type keeps them in its own
    wire order, so they are declared in each, not inherited)."""

    schema_version: int
    cluster: str
    node: str
    machine: str
    machine_source: str
    source: str
    chassis: str
    gpu: str
    read_time: str


def header(
    inventory: NodeInventory,
    gpu: GpuIdentity | None,
    *,
    source: str,
    read_time: str,
    cluster: str | None = None,
    node: str | None = None,
) -> Header:
    """The header of a record about `gpu` (None: the node, or a GPU no longer there) on the node
    of `inventory`; `cluster` and `node` default to the inventory's."""
    return Header(
        schema_version=SCHEMA_VERSION,
        cluster=inventory.cluster if cluster is None else cluster,
        node=inventory.node if node is None else node,
        machine=inventory.machine,
        machine_source=inventory.machine_source,
        source=source,
        chassis=(gpu.chassis_serial if gpu else None) or "",
        gpu=(gpu.serial if gpu else None) or "",
        read_time=read_time,
    )


@dataclass(frozen=True, slots=True)
class ReadingRecord:
    schema_version: int
    kind: Literal["reading"]
    # gpuid's fields, same names and meaning
    cluster: str
    node: str
    machine: str
    source: str
    chassis: str
    gpu: str
    read_time: str
    # ours
    uuid: str
    index: int
    model: str | None
    pci_bus_id: str | None
    module_id: int | None
    board_part_number: str | None
    driver_version: str | None
    machine_source: str
    mig_devices: tuple[str, ...]
    reason: str
    change: str


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    schema_version: int
    kind: Literal["allocation"]
    record_id: str
    event: Literal["start", "end", "usage"]
    cluster: str
    node: str
    machine: str
    machine_source: str
    source: str
    chassis: str
    gpu: str
    read_time: str
    allocation_id: str
    serial: str | None
    uuid: str
    gpu_index: int | None
    mig_uuid: str | None
    mig_gpu_instance_id: int | None
    mig_profile: str | None
    namespace: str
    pod: str
    pod_uid: str | None
    container: str
    resource_name: str
    device_id: str
    replica: int | None
    workload_kind: str | None
    workload_name: str | None
    started_at: str
    start_observed: bool
    ended_at: str | None
    end_observed: bool | None
    # Only an end the agent did not see (it happened while the agent was down) carries it.
    last_seen_at: str | None = None
    # Only an allocation through a DRA claim carries these (device-plugin records are as before)
    claim_namespace: str | None = None
    claim_name: str | None = None
    # "dra" (joined via ResourceSlices) or "dra-fallback", as at the start: an allocation is
    # not started again when its slices arrive, and its end repeats the start's fields
    claim_source: str | None = None
    # Accounting (docs/accounting.md), only where known: an end's totals for the allocation;
    # a usage record's amounts from `usage_start` to its read_time
    gpu_seconds: float | None = None
    energy_joules: float | None = None
    usage_start: str | None = None


@dataclass(frozen=True, slots=True)
class HealthRecord:
    schema_version: int
    kind: Literal["health"]
    cluster: str
    node: str
    machine: str
    source: str
    chassis: str
    gpu: str
    read_time: str
    uuid: str | None
    index: int | None
    check: str
    state: str
    previous_state: str | None
    action: str
    reason: str | None
    since: str
    gpu_state: str | None
    machine_source: str
    # pods, containers and workloads holding the GPU at that moment (from attribution)
    holders: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class HardwareRecord:
    """A physical GPU changed under the node: replaced (in its slot or another), or added."""

    schema_version: int
    kind: Literal["hardware"]
    record_id: str
    event: Literal["replaced", "added"]
    cluster: str
    node: str
    machine: str
    machine_source: str
    source: str
    chassis: str
    gpu: str  # the serial now in the slot
    read_time: str
    pci_bus_id: str
    old_serial: str | None
    new_serial: str | None
    uuid: str | None  # the new GPU's UUID
    index: int | None


AnyRecord = ReadingRecord | AllocationRecord | HealthRecord | HardwareRecord
