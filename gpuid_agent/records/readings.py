"""Reading records: the gpuid fields plus ours, with a deterministic id, emitted on change.

A record's id is a hash of what it says (identity fields and read time), so the same record
retried, spooled or re-sent after a restart keeps its id and sinks can deduplicate on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping

from gpuid_agent.model import GpuIdentity, NodeInventory
from gpuid_agent.records.consume import follow
from gpuid_agent.records.serialize import rfc3339
from gpuid_agent.records.types import SCHEMA_VERSION, ReadingRecord
from gpuid_agent.runtime import log
from gpuid_agent.state.bus import Subscription
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
        schema_version=SCHEMA_VERSION,
        kind="reading",
        cluster=inventory.cluster,
        node=inventory.node,
        machine=inventory.machine,
        source=source,
        chassis=gpu.chassis_serial or "",
        gpu=gpu.serial or "",
        read_time=read_time or rfc3339(inventory.read_time),
        uuid=gpu.uuid,
        index=gpu.index,
        model=gpu.name,
        pci_bus_id=gpu.pci_bus_id,
        module_id=gpu.module_id,
        board_part_number=gpu.board_part_number,
        driver_version=inventory.driver_version,
        machine_source=inventory.machine_source,
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


class ReadingEmitter:
    """Turns snapshots into records: on start, on any change, and every heartbeat interval.

    Snapshots arrive through `offer` (never blocks the collector); the emitter keeps only the
    latest, so under backpressure from a slow exporter intermediate states coalesce into the
    final one instead of piling up.
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
        self._wake = asyncio.Event()
        self._stopping = False

    def offer(self, inventory: NodeInventory) -> None:
        self._latest = inventory
        self._wake.set()

    def due(self, inventory: NodeInventory) -> list[ReadingRecord]:
        """Records owed for this snapshot now (empty when nothing changed and no heartbeat)."""
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

    async def _step(self) -> None:
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

    async def run(self, subscription: Subscription | None = None) -> None:
        """Emit until stopped; with a subscription, each snapshot's inventory is offered and
        the bus closing stops the emitter (after what the last snapshot owes)."""
        if subscription is None:
            await self._loop()
        else:
            await follow(subscription, self._offer_snapshot, self.stop, self._loop)

    def _offer_snapshot(self, snapshot: NodeSnapshot) -> None:
        self.offer(snapshot.inventory)

    async def _loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._time_to_heartbeat())
            self._wake.clear()
            await self._step()
        await self._step()  # the snapshot offered while the last publish was blocked

    def stop(self) -> None:
        """Finish the current publish, emit what the latest snapshot still owes, then return."""
        self._stopping = True
        self._wake.set()

    def _time_to_heartbeat(self) -> float | None:
        if self._emitted is None:
            return None
        return max(0.0, self._heartbeat - (self._clock() - self._last_emit))
