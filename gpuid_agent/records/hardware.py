"""`kind=hardware` records: a physical GPU swapped under the node, told exactly once.

Which GPU was replaced or added is `state.gpu_slots`'s (the serial per PCI bus id, kept in
`<STATE_DIR>/hardware.json`). Exactly once: the new slots and the records they owe are written
to the state file before they are published (`publish_durable`), and the owed records are
cleared once every exporter's store holds them. A kill in between re-publishes them at the next
start under the same record ids (`record_id` hashes machine, bus id, event and both serials), so
exporters deduplicate.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.durable import publish_owed
from gpuid_agent.records.runner import Emitter
from gpuid_agent.records.serialize import rfc3339, to_wire
from gpuid_agent.records.types import AnyRecord, HardwareRecord, header
from gpuid_agent.runtime import log
from gpuid_agent.state.gpu_slots import GpuSlots, SlotChange
from gpuid_agent.state.snapshot import NodeSnapshot
from gpuid_agent.state.state_file import StateDir

_log = log.get("hardware")


def hardware_record(
    inventory: NodeInventory, change: SlotChange, *, cluster: str, source: str
) -> HardwareRecord:
    event, bus, old, new = change
    gpu: GpuIdentity | None = next(
        (g for g in inventory.gpus if (g.pci_bus_id or "").lower() == bus and g.serial == new),
        None,
    )
    digest = "\x1f".join(("hardware", inventory.machine, bus, event, old or "", new or ""))
    envelope = header(
        inventory, gpu, source=source, read_time=rfc3339(inventory.read_time), cluster=cluster
    )
    envelope["gpu"] = new or old or ""  # the serial now in the slot, even if it did not read
    return HardwareRecord(
        kind="hardware",
        record_id=hashlib.sha256(digest.encode()).hexdigest()[:32],
        event=event,
        **envelope,
        pci_bus_id=gpu.pci_bus_id or bus if gpu else bus,
        old_serial=old,
        new_serial=new,
        uuid=gpu.uuid if gpu else None,
        index=gpu.index if gpu else None,
    )


class HardwareWatch(Emitter):
    def __init__(
        self,
        *,
        cluster: str,
        source: str,
        publish_durable: Callable[[list[AnyRecord]], Awaitable[None]],
        state_dir: StateDir | None = None,
    ) -> None:
        self._cluster, self._source = cluster, source
        self._publish_durable = publish_durable
        self.slots = GpuSlots(state_dir)
        self.sent = 0
        self._latest: NodeSnapshot | None = None
        # told of each change found, with the snapshot it was found in (Node events)
        self.listeners: list[Callable[[Sequence[HardwareRecord], NodeSnapshot], None]] = []

    def owed(self, inventory: NodeInventory) -> list[HardwareRecord]:
        """Records for what changed since the last inventory; updates the slots."""
        records = [
            hardware_record(inventory, c, cluster=self._cluster, source=self._source)
            for c in self.slots.update(inventory)
        ]
        for r in records:
            _log.warning(
                f"GPU {r.event}",
                extra={
                    "pci_bus_id": r.pci_bus_id,
                    "old_serial": r.old_serial,
                    "new_serial": r.new_serial,
                    "machine": r.machine,
                },
            )
        return records

    def note(self, snapshot: NodeSnapshot) -> None:
        self._latest = snapshot

    async def flush(self) -> None:
        snapshot, self._latest = self._latest, None
        state = self.slots
        before = None if state.serials is None else dict(state.serials)
        if snapshot is not None and (found := self.owed(snapshot.inventory)):
            state.pending.extend(to_wire(r) for r in found)
            for listener in self.listeners:
                listener(found, snapshot)
        if state.pending:  # on the first flush: left by a kill before they reached the stores
            self.sent += await publish_owed(state, self._publish_durable)
        elif state.serials != before:
            await state.save()  # a new baseline

    def status(self) -> dict[str, Any]:
        path = self.slots.path
        return {
            "gpus": len(self.slots.serials or {}),
            "state_file": str(path) if path else None,
            "records_sent": self.sent,
            "pending": len(self.slots.pending),
        }
