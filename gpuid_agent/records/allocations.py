"""The allocation trail: a `kind=allocation` record when a container gets a GPU (or MIG device)
and another when it lets go, through the same exporter pipeline as the readings.

Ids are deterministic. `allocation_id` hashes what identifies the allocation (cluster, node,
namespace, pod, pod UID when the API gives it, container, resource, device id), so an exporter
can update one row when the end arrives, and an agent restart finds the same id again. The
record id hashes (allocation_id, event): a start re-sent after a restart has the start's id.

What started and ended, and what survives a restart, is `state.allocation_trail`'s: with
STATE_DIR an allocation that ended while the agent was down is closed with `end_observed: false`
and `last_seen_at` = when it was last known open (the state file is re-saved every minute), and
the records a change owes are saved with the new open set before they are published, so a kill
in between re-publishes them (same record ids) instead of losing them. Without STATE_DIR the
agent re-announces the open allocations under the same record ids, and allocations that ended
while it was down are never closed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.durable import publish_owed
from gpuid_agent.records.runner import Emitter
from gpuid_agent.records.serialize import allocation_from_wire, rfc3339, to_wire
from gpuid_agent.records.types import AllocationRecord, AnyRecord, header
from gpuid_agent.records.usage import UsageLedger
from gpuid_agent.runtime import log
from gpuid_agent.state.allocation_trail import Ended, OpenAllocations, Started
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.snapshot import NodeSnapshot
from gpuid_agent.state.state_file import StateDir, WireRecord

_log = log.get("allocations")
STATE_REFRESH = 60.0


def _digest(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "replace")).hexdigest()[:32]


def allocation_id(cluster: str, node: str, allocation: Allocation) -> str:
    h = allocation.holder
    return _digest(
        "allocation",
        cluster,
        node,
        h.namespace,
        h.pod,
        h.pod_uid,
        h.container,
        allocation.resource_name,
        allocation.device_id,
    )


def allocation_record_id(alloc_id: str, event: str) -> str:
    return _digest(alloc_id, event)


@dataclass(frozen=True, slots=True)
class TrailIdentity:
    """The record envelope fields that do not change for the agent's life."""

    cluster: str
    node: str
    source: str


def start_record(
    identity: TrailIdentity, started: Started, inventory: NodeInventory, now: datetime
) -> AllocationRecord:
    a = started.allocation
    gpu = inventory.gpu_by_uuid().get(a.gpu_uuid)
    mig = next((m for m in gpu.mig_devices if m.uuid == a.mig_uuid), None) if gpu else None
    h = a.holder
    alloc_id = allocation_id(identity.cluster, identity.node, a)
    at = rfc3339(now)
    return AllocationRecord(
        kind="allocation",
        record_id=allocation_record_id(alloc_id, "start"),
        event="start",
        # the machine is the inventory's: the providerID may arrive after start
        **header(
            inventory,
            gpu,
            source=identity.source,
            read_time=at,
            cluster=identity.cluster,
            node=identity.node,
        ),
        allocation_id=alloc_id,
        serial=gpu.serial if gpu else None,
        uuid=a.gpu_uuid,
        gpu_index=gpu.index if gpu else None,
        mig_uuid=a.mig_uuid,
        mig_gpu_instance_id=mig.gpu_instance_id if mig else None,
        mig_profile=mig.profile if mig else None,
        namespace=h.namespace,
        pod=h.pod,
        pod_uid=h.pod_uid or None,
        container=h.container,
        resource_name=a.resource_name,
        device_id=a.device_id,
        replica=a.replica,
        workload_kind=h.workload_kind or None,
        workload_name=h.workload_name or None,
        started_at=at,
        start_observed=started.observed,
        ended_at=None,
        end_observed=None,
        claim_namespace=a.claim.namespace if a.claim else None,
        claim_name=a.claim.name if a.claim else None,
        claim_source=a.claim.source if a.claim else None,
    )


def end_record(
    ended: Ended,
    now: datetime,
    gpu_seconds: float | None = None,
    energy_joules: float | None = None,
) -> AllocationRecord:
    """The end repeats its start's fields (the GPU may be gone by now), with what the
    allocation used where accounting knows it."""
    at = rfc3339(now)
    begun = allocation_from_wire(ended.start)
    return replace(
        begun,
        record_id=allocation_record_id(begun.allocation_id, "end"),
        event="end",
        read_time=at,
        ended_at=at,
        end_observed=ended.observed,
        last_seen_at=ended.last_seen_at,
        gpu_seconds=gpu_seconds,
        energy_joules=energy_joules,
    )


def idle_start(identity: TrailIdentity, gpu: GpuIdentity, inventory: NodeInventory) -> WireRecord:
    """The never-published start of a GPU's idle "allocation": nobody's (`namespace` and `pod`
    empty), its usage records carry the GPU's unheld time and energy per period, so that a
    node's usage records add up to its GPUs' time and energy counters."""
    nobody = Allocation(Holder("", "", ""), "", gpu.uuid, gpu.uuid)
    start = start_record(
        identity, Started(("", "", "", "", ""), nobody, True), inventory, inventory.read_time
    )
    alloc_id = _digest("idle", identity.cluster, identity.node, gpu.uuid)
    record_id = allocation_record_id(alloc_id, "start")
    return to_wire(replace(start, allocation_id=alloc_id, record_id=record_id))


class AllocationTrail(Emitter):
    """Turns the attributions of snapshots whose pod metadata is in (`pods_ready`) into
    allocation records, hands them durably to the pipeline (`Pipeline.publish_durable`), then
    saves the state file."""

    def __init__(
        self,
        identity: TrailIdentity,
        *,
        publish_durable: Callable[[list[AnyRecord]], Awaitable[None]],
        state_dir: StateDir | None = None,
        usage_interval: float = 3600.0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.identity = identity
        self._publish_durable = publish_durable
        self._clock = clock
        self.started_at = clock()
        self.allocations = OpenAllocations(
            identity.node, state_dir, stamp=lambda: rfc3339(self._clock())
        )
        self._latest: tuple[Attribution, NodeInventory] | None = None
        self.usage = UsageLedger(usage_interval, self.allocations.usage, allocation_record_id)
        self._taken: Attribution | None = None  # the last attribution diffed in full
        self._inventory: NodeInventory | None = None
        self.idle: dict[str, WireRecord] = {}  # GPU UUID → its idle start (see `idle_start`)

    def owed(self, attribution: Attribution, inventory: NodeInventory) -> list[AllocationRecord]:
        """Records owed for this attribution (ends, then starts); updates the open set. The
        attribution last taken in full owes nothing more (it is kept while unchanged)."""
        if attribution is self._taken:
            return []
        changes = self.allocations.update(attribution)
        if changes is None:
            return []
        now = self._clock()
        still_open = list(self.allocations.open.values())
        records: list[AllocationRecord] = []
        for e in changes.ended:
            usage, seconds, joules = self.usage.closed(e.start, now, still_open)
            records += [usage] if usage is not None else []
            records.append(end_record(e, now, seconds, joules))
        for started in changes.started:
            start = start_record(self.identity, started, inventory, now)
            wire = to_wire(start)
            self.allocations.opened(started.key, wire)
            self.usage.opened(wire, now, list(self.allocations.open.values()))
            records.append(start)
        self._taken = attribution
        return records

    def idle_owed(self, now: datetime) -> list[AllocationRecord]:
        """Idle usage records: a GPU seen for the first time starts its ledger (a mark the
        state file kept is taken back), one gone ends it with its last partial record."""
        inventory = self._inventory
        if inventory is None:
            return []
        marks, records = self.usage.marks, []
        gpus = {g.uuid: g for g in inventory.gpus}
        if not self.idle:  # the first look: drop marks of GPUs that left while the agent was down
            kept = {s["allocation_id"] for s in self.allocations.open.values()}
            kept |= {_digest("idle", self.identity.cluster, self.identity.node, u) for u in gpus}
            for stale in [a for a in marks if a not in kept]:
                del marks[stale]
        for uuid in [u for u in self.idle if u not in gpus]:
            record, _, _ = self.usage.closed(self.idle.pop(uuid), now, [])
            records += [record] if record is not None else []
        for uuid, gpu in gpus.items():
            if uuid not in self.idle:
                start = self.idle[uuid] = idle_start(self.identity, gpu, inventory)
                if start["allocation_id"] not in marks:
                    self.usage.opened(start, now, [])
        return records + self.usage.due(list(self.idle.values()), now)

    def note(self, snapshot: NodeSnapshot) -> None:
        self.usage.view = snapshot.accounting
        self._inventory = snapshot.inventory
        if snapshot.pods_ready and snapshot.attribution.state == "current":
            self._latest = (snapshot.attribution, snapshot.inventory)

    async def flush(self) -> None:
        latest, self._latest = self._latest, None
        state = self.allocations
        records = self.owed(*latest) if latest is not None else []
        if state.settled:  # long allocations and idle GPUs: a usage record per period
            now = self._clock()
            records += self.usage.due(list(state.open.values()), now) + self.idle_owed(now)
        if records:
            _log.debug("allocation records", extra={"count": len(records)})
            state.pending = state.pending + [to_wire(r) for r in records]
        if state.pending:  # on the first flush: left by a kill before they reached the spools
            await publish_owed(state, self._publish_durable)

    def next_tick(self) -> float:
        return STATE_REFRESH

    async def tick(self) -> None:
        await self.allocations.refresh()

    def status(self) -> dict[str, Any]:
        path = self.allocations.path
        return {"open": len(self.allocations.open), "state_file": str(path) if path else None}
