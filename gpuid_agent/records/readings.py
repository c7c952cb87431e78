"""Reading records: the gpuid fields plus ours, with a deterministic id, emitted on change.

A record's id is a hash of what it says (identity fields and read time), so the same record
retried, spooled or re-sent after a restart keeps its id and sinks can deduplicate on it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.runner import Emitter
from gpuid_agent.records.serialize import rfc3339
from gpuid_agent.records.types import SCHEMA_VERSION, ReadingRecord, header
from gpuid_agent.runtime import log
from gpuid_agent.state.inventory import diff
from gpuid_agent.state.snapshot import NodeSnapshot

__all__ = ["SCHEMA_VERSION", "ReadingEmitter", "reading_record", "rfc3339"]
_log = log.get("records")


def reading_record(
    inventory: NodeInventory,
    gpu: GpuIdentity,
    *,
    source: str,
    reason: str,
    change: str,
    read_time: str = "",
) -> ReadingRecord:
    """`read_time` is the inventory's, formatted once by the caller for a whole node."""
    return ReadingRecord(
        kind="reading",
        **header(
            inventory, gpu, source=source, read_time=read_time or rfc3339(inventory.read_time)
        ),
        uuid=gpu.uuid,
        index=gpu.index,
        model=gpu.name,
        pci_bus_id=gpu.pci_bus_id,
        module_id=gpu.module_id,
        board_part_number=gpu.board_part_number,
        driver_version=inventory.driver_version,
        mig_devices=tuple(m.uuid for m in gpu.mig_devices),
        reason=reason,
        change=change,
    )


def reading_records(
    inventory: NodeInventory,
    *,
    source: str,
    reason: str,
    changed: Mapping[str, str] | None = None,
    removed: Iterable[GpuIdentity] = (),
) -> list[ReadingRecord]:
    """One record per GPU (GB200's die pairs stay separate, with their shared serial)."""
    changed = changed or {}
    at = rfc3339(inventory.read_time)
    records = [
        reading_record(
            inventory,
            gpu,
            source=source,
            reason=reason,
            change=changed.get(gpu.uuid, "unchanged"),
            read_time=at,
        )
        for gpu in inventory.gpus
    ]
    records.extend(
        reading_record(inventory, gpu, source=source, reason=reason, change="removed", read_time=at)
        for gpu in removed
    )
    return records


class ReadingEmitter(Emitter):
    """Turns snapshots into records: on start, on any change, and every heartbeat interval.

    Only the latest snapshot's inventory counts: under backpressure from a slow exporter,
    intermediate states coalesce into the final one instead of piling up.
    """

    def __init__(
        self,
        *,
        source: str,
        heartbeat_interval: float,
        publish: Callable[[list[ReadingRecord]], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source = source
        self._heartbeat = heartbeat_interval
        self._publish = publish
        self._clock = clock
        self._latest: NodeInventory | None = None
        self._emitted: NodeInventory | None = None
        self._last_emit = 0.0

    def note(self, snapshot: NodeSnapshot) -> None:
        self._latest = snapshot.inventory

    def due(self, inventory: NodeInventory) -> list[ReadingRecord]:
        """Records owed for this inventory now (empty when nothing changed and no heartbeat)."""
        changes = diff(self._emitted, inventory)
        first = self._emitted is None
        heartbeat = self._clock() - self._last_emit >= self._heartbeat
        if not first and not changes and not heartbeat:
            return []
        reason = "startup" if first else ("change" if changes else "heartbeat")
        changed = {c.uuid: c.kind for c in changes if c.uuid and c.kind != "removed"}
        removed = [c.before for c in changes if c.kind == "removed" and c.before]
        if first:
            changed = {}
        return reading_records(
            inventory, source=self._source, reason=reason, changed=changed, removed=removed
        )

    async def flush(self) -> None:
        inventory = self._latest
        if inventory is None:
            return
        first = self._emitted is None
        records = self.due(inventory)
        if records or first:
            self._emitted = inventory
            self._last_emit = self._clock()
        if records:
            _log.debug("emitting readings", extra={"count": len(records)})
            await self._publish(records)

    def next_tick(self) -> float | None:
        """The next heartbeat (none before the first emission)."""
        if self._emitted is None:
            return None
        return max(0.0, self._heartbeat - (self._clock() - self._last_emit))
