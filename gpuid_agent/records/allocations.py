"""The allocation trail: a `kind=allocation` record when a container gets a GPU (or MIG device)
and another when it lets go, through the same exporter pipeline as the readings.

Ids are deterministic. `allocation_id` hashes what identifies the allocation (cluster, node,
namespace, pod, pod UID when the API gives it, container, resource, device id), so an exporter
can update one row when the end arrives, and an agent restart finds the same id again. The
record id hashes (allocation_id, event): a start re-sent after a restart has the start's id.

Restarts: open allocations are kept in `<STATE_DIR>/allocations.json`. After a restart the
first good kubelet snapshot is compared with that file: what is still there stays open (no
second start); what is gone ended while the agent was down and is closed with ended_at = the
time the agent saw it gone, `end_observed: false` and `last_seen_at` = when it was last known
open (the file is re-saved every minute). The records a change owes are written into the file
with the new open set before they are published, and cleared once every exporter's spool holds
them: a kill in between re-publishes them on restart (same record ids) instead of losing a start
or an end whose allocation is gone by then. Without STATE_DIR the agent re-announces the open
allocations under the same record ids, and allocations that ended while it was down are never
closed.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from gpuid_agent.model import NodeInventory
from gpuid_agent.records.consume import follow
from gpuid_agent.records.serialize import allocation_from_wire, rfc3339, to_wire
from gpuid_agent.records.state_file import write_atomically
from gpuid_agent.records.types import SCHEMA_VERSION, AllocationRecord
from gpuid_agent.runtime import log
from gpuid_agent.state.attribution import Allocation, Attribution
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("allocations")
STATE_FILE = "allocations.json"
STATE_VERSION = 1
STATE_REFRESH = 60.0
# Key of an allocation while it is open: one device id of one container.
Key = tuple[str, str, str, str, str]


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


def _key(a: Allocation) -> Key:
    h = a.holder
    return (h.namespace, h.pod, h.container, a.resource_name, a.device_id)


@dataclass(frozen=True, slots=True)
class TrailIdentity:
    """The record envelope fields that do not change for the agent's life."""

    cluster: str
    node: str
    source: str


class AllocationTrail:
    """Turns attribution snapshots into allocation records; one task publishes them.

    `offer` never blocks (the latest snapshot wins, like the reading emitter); `run` diffs
    it against the open allocations, hands the records durably to the pipeline
    (`Pipeline.publish_durable`), then saves the state file.
    """

    def __init__(
        self,
        identity: TrailIdentity,
        *,
        publish_durable: Callable[[list[AllocationRecord]], Awaitable[None]],
        state_dir: str = "",
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.identity = identity
        self._publish_durable = publish_durable
        self._clock = clock
        self.state_path = Path(state_dir) / STATE_FILE if state_dir else None
        self.open: dict[Key, AllocationRecord] = {}
        self._restored = False
        self.pending: list[
            AllocationRecord
        ] = []  # owed by the saved open set, not yet in every spool
        self._restored_saved_at = ""
        self._first = True
        self._latest: tuple[Attribution, NodeInventory] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self.started_at = clock()
        self._load()

    # ---- state file ------------------------------------------------------------------------

    def _load(self) -> None:
        if self.state_path is None:
            return
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            _log.warning("cannot read allocation state", extra={"error": str(exc)})
            return
        try:
            state = orjson.loads(raw)
            if state.get("version") != STATE_VERSION or state.get("node") != self.identity.node:
                raise ValueError("state file is for another version or node")
            records = [allocation_from_wire(r) for r in state["open"] if isinstance(r, dict)]
            opened = {self._record_key(r): r for r in records}
            pending = [
                allocation_from_wire(r) for r in state.get("pending", []) if isinstance(r, dict)
            ]
        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # A damaged file must not stop the agent: start over, as without STATE_DIR.
            _log.warning(
                "ignoring unreadable allocation state",
                extra={"path": str(self.state_path), "error": str(exc)},
            )
            return
        self.open, self.pending = opened, pending
        self._restored = True
        self._restored_saved_at = str(state.get("saved_at") or "")
        _log.info("restored open allocations", extra={"count": len(opened)})

    @staticmethod
    def _record_key(record: AllocationRecord) -> Key:
        r = record
        return (r.namespace, r.pod, r.container, r.resource_name, r.device_id)

    def _state_bytes(self) -> bytes:
        return orjson.dumps(
            {
                "version": STATE_VERSION,
                "node": self.identity.node,
                "saved_at": rfc3339(self._clock()),
                "open": [
                    to_wire(r) for r in sorted(self.open.values(), key=lambda r: r.allocation_id)
                ],
                "pending": [to_wire(r) for r in self.pending],
            },
            option=orjson.OPT_SORT_KEYS,
        )

    def _write_state(self, payload: bytes) -> None:
        assert self.state_path is not None
        write_atomically(self.state_path, payload)

    async def _save(self) -> None:
        if self.state_path is None:
            return
        try:
            await asyncio.to_thread(self._write_state, self._state_bytes())
        except OSError as exc:
            _log.warning("cannot save allocation state", extra={"error": str(exc)})

    # ---- records ---------------------------------------------------------------------------

    def _start_record(
        self, a: Allocation, inventory: NodeInventory, now: datetime, observed: bool
    ) -> AllocationRecord:
        gpu = inventory.gpu_by_uuid().get(a.gpu_uuid)
        mig = next((m for m in gpu.mig_devices if m.uuid == a.mig_uuid), None) if gpu else None
        h = a.holder
        alloc_id = allocation_id(self.identity.cluster, self.identity.node, a)
        started = rfc3339(now)
        return AllocationRecord(
            schema_version=SCHEMA_VERSION,
            kind="allocation",
            record_id=allocation_record_id(alloc_id, "start"),
            event="start",
            cluster=self.identity.cluster,
            node=self.identity.node,
            machine=inventory.machine,  # the providerID may arrive after start
            machine_source=inventory.machine_source,
            source=self.identity.source,
            chassis=(gpu.chassis_serial if gpu else None) or "",
            gpu=(gpu.serial if gpu else None) or "",
            read_time=started,
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
            started_at=started,
            start_observed=observed,
            ended_at=None,
            end_observed=None,
            claim_namespace=a.claim.namespace if a.claim else None,
            claim_name=a.claim.name if a.claim else None,
            claim_source=a.claim.source if a.claim else None,
        )

    def _end_record(
        self, start: AllocationRecord, now: datetime, observed: bool
    ) -> AllocationRecord:
        ended = rfc3339(now)
        return replace(
            start,
            record_id=allocation_record_id(start.allocation_id, "end"),
            event="end",
            read_time=ended,
            ended_at=ended,
            end_observed=observed,
            last_seen_at=None if observed else (self._restored_saved_at or None),
        )

    def diff(self, attribution: Attribution, inventory: NodeInventory) -> list[AllocationRecord]:
        """Records owed for this snapshot; updates the open set. Only a current attribution
        counts: a stale or missing mapping ends nothing."""
        if attribution.state != "current":
            return []
        now = self._clock()
        first, restored = self._first, self._restored
        self._first = False
        current: dict[Key, Allocation] = {}
        for a in attribution.allocations:
            current.setdefault(_key(a), a)
        records: list[AllocationRecord] = []
        for key, start in list(self.open.items()):
            held = current.get(key)
            same_pod = held is not None and (
                not held.holder.pod_uid or not start.pod_uid or held.holder.pod_uid == start.pod_uid
            )
            if not same_pod:
                # Seen gone on the first look after a restart: it ended while we were down.
                observed = not (first and restored)
                records.append(self._end_record(start, now, observed))
                del self.open[key]
        for key, a in current.items():
            if key in self.open:
                continue
            # Found at start-up without a state file to tell: the start was not seen.
            observed = not first
            start = self._start_record(a, inventory, now, observed)
            self.open[key] = start
            records.append(start)
        return records

    # ---- task ------------------------------------------------------------------------------

    def offer(self, attribution: Attribution, inventory: NodeInventory) -> None:
        if attribution.state == "current":
            self._latest = (attribution, inventory)
            self._wake.set()

    async def _deliver(self) -> None:
        # Write-ahead: the saved open set already counts these records as sent, so they are
        # saved with it as pending, handed durably to every exporter, then cleared. A kill at
        # any point re-publishes them on restart under the same record ids; none is lost.
        await self._save()
        await self._publish_durable(self.pending)
        self.pending = []
        await self._save()

    async def _step(self) -> None:
        latest, self._latest = self._latest, None
        if latest is None:
            return
        records = self.diff(*latest)
        if records:
            _log.debug("allocation records", extra={"count": len(records)})
            self.pending = self.pending + records
            await self._deliver()

    async def run(self, subscription: Subscription | None = None) -> None:
        """With a subscription, snapshots whose pod metadata is in (`pods_ready`) and whose
        attribution is current are offered; the bus closing stops the trail."""
        if subscription is None:
            await self._loop()
        else:
            await follow(subscription, self._offer_snapshot, self.stop, self._loop)

    def _offer_snapshot(self, snapshot: NodeSnapshot) -> None:
        if snapshot.pods_ready:
            self.offer(snapshot.attribution, snapshot.inventory)

    async def _loop(self) -> None:
        """Publish what each offered snapshot owes. The state file is also re-saved every
        STATE_REFRESH seconds while allocations are open, so after a crash `last_seen_at`
        bounds when an allocation that vanished meanwhile was last known to be open."""
        if self.pending:  # left by a kill between saving the state file and publishing
            await self._deliver()
        while not self._stopping:
            try:
                async with asyncio.timeout(STATE_REFRESH):  # not wait_for: 3.11's can eat a cancel
                    await self._wake.wait()
            except TimeoutError:
                if self.open and not self._first:
                    await self._save()
                continue
            self._wake.clear()
            await self._step()
        await self._step()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def status(self) -> dict[str, Any]:
        return {
            "open": len(self.open),
            "state_file": str(self.state_path) if self.state_path else None,
        }
