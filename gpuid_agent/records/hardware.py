"""`kind=hardware` records: a physical GPU swapped under the node, told exactly once.

The serial of the GPU at each PCI bus id is kept in `<STATE_DIR>/hardware.json`. When an
inventory shows another serial at a bus id, that GPU was **replaced**; a serial that left the
node while another arrived at a different bus id is a replacement too (pairs in bus id order).
A GPU that vanished is remembered rather than reported (a GPU off the bus comes back after a
reset); a new serial in a new slot with nothing gone to pair it with was **added**. The first
inventory without a state file is the baseline and says nothing.

Exactly once: the new map and the records it owes are written to the state file before they
are published (`publish_durable`), and the owed records are cleared once every exporter's
store holds them. A kill in between re-publishes them at the next start under the same record
ids (`record_id` hashes machine, bus id, event and both serials), so exporters deduplicate.
Without STATE_DIR the comparison lives as long as the process.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from gpuid_agent.model import GpuIdentity, NodeInventory
from gpuid_agent.records.consume import follow
from gpuid_agent.records.serialize import WireError, from_wire, rfc3339, to_wire
from gpuid_agent.records.state_file import write_atomically
from gpuid_agent.records.types import SCHEMA_VERSION, AnyRecord, HardwareRecord
from gpuid_agent.runtime import log
from gpuid_agent.state.bus import Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

_log = log.get("hardware")
STATE_FILE = "hardware.json"
STATE_VERSION = 1
Slots = dict[str, str]  # PCI bus id -> serial


def slots_of(inventory: NodeInventory) -> Slots:
    """Bus id → serial of every GPU that reports both (bus ids compared case-insensitively)."""
    return {g.pci_bus_id.lower(): g.serial for g in inventory.gpus if g.pci_bus_id and g.serial}


Change = tuple[str, str, str | None, str | None]  # (event, bus id, old serial, new serial)


def changes(before: Slots, after: Slots) -> tuple[list[Change], Slots]:
    """What changed from the remembered slots to the GPUs present now, in bus id order, and
    the slots to remember next.

    A slot whose GPU is gone (fallen off the bus, or pulled) says nothing yet and is
    remembered: if the same serial comes back, nothing happened; if another serial arrives,
    in that slot or a new one, that is the replacement. A new serial in a new slot with no
    vanished GPU to pair with was **added**.
    """
    out: list[Change] = []
    known, present = set(before.values()), set(after.values())
    for bus in sorted(before.keys() & after.keys()):
        old, new = before[bus], after[bus]
        if old != new and old not in present and new not in known:
            out.append(("replaced", bus, old, new))
    left = sorted((b, s) for b, s in before.items() if b not in after and s not in present)
    arrived = sorted((b, s) for b, s in after.items() if b not in before and s not in known)
    for (_, old), (bus, new) in zip(left, arrived, strict=False):
        out.append(("replaced", bus, old, new))
    out.extend(("added", bus, None, new) for bus, new in arrived[len(left) :])
    remembered = dict(after)
    remembered.update(left[len(arrived) :])  # still gone: wait for what comes back
    return out, remembered


def _hardware(record: AnyRecord) -> HardwareRecord:
    if not isinstance(record, HardwareRecord):
        raise WireError(f"a {record.kind} record among the owed hardware records")
    return record


class HardwareWatch:
    def __init__(
        self,
        *,
        cluster: str,
        source: str,
        publish_durable: Callable[[list[HardwareRecord]], Awaitable[None]],
        state_dir: str = "",
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._cluster, self._source = cluster, source
        self._publish_durable = publish_durable
        self._clock = clock
        self.state_path = Path(state_dir) / STATE_FILE if state_dir else None
        self.slots: Slots | None = None  # None: no baseline yet
        self.pending: list[HardwareRecord] = []
        self.sent = 0
        self._latest: NodeInventory | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._load()

    # ---- state file ------------------------------------------------------------------------

    def _load(self) -> None:
        if self.state_path is None:
            return
        try:
            state = orjson.loads(self.state_path.read_bytes())
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"state version {state.get('version')!r}")
            slots = state["slots"]
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in slots.items()):
                raise ValueError("slots must map bus ids to serials")
            pending = [
                _hardware(from_wire(r)) for r in state.get("pending", []) if isinstance(r, dict)
            ]
        except FileNotFoundError:
            return
        except (
            OSError,
            orjson.JSONDecodeError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            _log.warning(
                "ignoring unreadable hardware state: the next inventory is the baseline",
                extra={"path": str(self.state_path), "error": str(exc)},
            )
            return
        self.slots, self.pending = dict(slots), pending

    def _write(self) -> None:
        assert self.state_path is not None
        payload = orjson.dumps(
            {
                "version": STATE_VERSION,
                "slots": self.slots or {},
                "pending": [to_wire(r) for r in self.pending],
            },
            option=orjson.OPT_SORT_KEYS,
        )
        write_atomically(self.state_path, payload)

    async def _save(self) -> None:
        if self.state_path is not None:
            try:
                await asyncio.to_thread(self._write)
            except OSError as exc:
                _log.warning("cannot save hardware state", extra={"error": str(exc)})

    # ---- records ---------------------------------------------------------------------------

    def _record(self, inventory: NodeInventory, change: Change) -> HardwareRecord:
        event, bus, old, new = change
        gpu: GpuIdentity | None = next(
            (g for g in inventory.gpus if (g.pci_bus_id or "").lower() == bus and g.serial == new),
            None,
        )
        digest = "\x1f".join(("hardware", inventory.machine, bus, event, old or "", new or ""))
        return HardwareRecord(
            schema_version=SCHEMA_VERSION,
            kind="hardware",
            record_id=hashlib.sha256(digest.encode()).hexdigest()[:32],
            event=event,  # type: ignore[arg-type]
            cluster=self._cluster,
            node=inventory.node,
            machine=inventory.machine,
            machine_source=inventory.machine_source,
            source=self._source,
            chassis=(gpu.chassis_serial if gpu else None) or "",
            gpu=new or old or "",
            read_time=rfc3339(inventory.read_time),
            pci_bus_id=gpu.pci_bus_id or bus if gpu else bus,
            old_serial=old,
            new_serial=new,
            uuid=gpu.uuid if gpu else None,
            index=gpu.index if gpu else None,
        )

    def diff(self, inventory: NodeInventory) -> list[HardwareRecord]:
        """Records for what changed since the last inventory; updates the baseline."""
        now = slots_of(inventory)
        if self.slots is not None:
            # a GPU still in its slot whose serial did not read this time keeps the old one
            unread = {(g.pci_bus_id or "").lower() for g in inventory.gpus if not g.serial}
            now.update((bus, s) for bus, s in self.slots.items() if bus in unread)
        if self.slots is None or not now:
            # no baseline yet, or NVML read no serial at all (a driver fault is no swap)
            self.slots = now or self.slots
            return []
        found, self.slots = changes(self.slots, now)
        records = [self._record(inventory, c) for c in found]
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

    # ---- loop --------------------------------------------------------------------------------

    def offer(self, inventory: NodeInventory) -> None:
        self._latest = inventory
        self._wake.set()

    async def _deliver(self) -> None:
        await self._save()  # the owed records are on disk before anyone can see them
        await self._publish_durable(self.pending)
        self.sent += len(self.pending)
        self.pending = []
        await self._save()

    async def _step(self) -> None:
        inventory, self._latest = self._latest, None
        before = None if self.slots is None else dict(self.slots)
        if inventory is not None:
            self.pending.extend(self.diff(inventory))
        if self.pending:
            await self._deliver()
        elif self.slots != before:
            await self._save()  # a new baseline

    async def run(self, subscription: Subscription | None = None) -> None:
        if subscription is None:
            await self._loop()
        else:
            await follow(subscription, self._offer_snapshot, self.stop, self._loop)

    def _offer_snapshot(self, snapshot: NodeSnapshot) -> None:
        self.offer(snapshot.inventory)

    async def _loop(self) -> None:
        if self.pending:
            await self._deliver()  # owed by the last run
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            await self._step()
        await self._step()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def status(self) -> dict[str, Any]:
        return {
            "gpus": len(self.slots or {}),
            "state_file": str(self.state_path) if self.state_path else None,
            "records_sent": self.sent,
            "pending": len(self.pending),
        }
