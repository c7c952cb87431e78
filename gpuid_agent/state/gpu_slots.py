"""The serial of the GPU at each PCI bus id, remembered across restarts, and what changed.

The slots are kept in `<STATE_DIR>/hardware.json`. When an inventory shows another serial at a
bus id, that GPU was **replaced**; a serial that left the node while another arrived at a
different bus id is a replacement too (pairs in bus id order). A GPU that vanished is remembered
rather than reported (a GPU off the bus comes back after a reset); a new serial in a new slot
with nothing gone to pair it with was **added**. The first inventory without a state file is
the baseline and says nothing. The file also keeps the records a change owes (`pending`) until
every exporter's store holds them. Without STATE_DIR the slots live as long as the process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal, NamedTuple

import orjson

from gpuid_agent.facts import NodeInventory
from gpuid_agent.runtime import formats, log
from gpuid_agent.state.state_file import StateDir, WireRecord, write_atomically

_log = log.get("hardware")
STATE_FILE = formats.HARDWARE
Slots = dict[str, str]  # PCI bus id -> serial


class SlotChange(NamedTuple):
    event: Literal["replaced", "added"]
    bus: str  # lower case
    old: str | None
    new: str | None


def slots_of(inventory: NodeInventory) -> Slots:
    """Bus id → serial of every GPU that reports both (bus ids compared case-insensitively)."""
    return {g.pci_bus_id.lower(): g.serial for g in inventory.gpus if g.pci_bus_id and g.serial}


def changes(before: Slots, after: Slots) -> tuple[list[SlotChange], Slots]:
    """What changed from the remembered slots to the GPUs present now, in bus id order, and
    the slots to remember next.

    A slot whose GPU is gone (fallen off the bus, or pulled) says nothing yet and is
    remembered: if the same serial comes back, nothing happened; if another serial arrives,
    in that slot or a new one, that is the replacement. A new serial in a new slot with no
    vanished GPU to pair with was **added**.
    """
    out: list[SlotChange] = []
    known, present = set(before.values()), set(after.values())
    for bus in sorted(before.keys() & after.keys()):
        old, new = before[bus], after[bus]
        if old != new and old not in present and new not in known:
            out.append(SlotChange("replaced", bus, old, new))
    left = sorted((b, s) for b, s in before.items() if b not in after and s not in present)
    arrived = sorted((b, s) for b, s in after.items() if b not in before and s not in known)
    for (_, old), (bus, new) in zip(left, arrived, strict=False):
        out.append(SlotChange("replaced", bus, old, new))
    out.extend(SlotChange("added", bus, None, new) for bus, new in arrived[len(left) :])
    remembered = dict(after)
    remembered.update(left[len(arrived) :])  # still gone: wait for what comes back
    return out, remembered


class GpuSlots:
    """The remembered serial per slot (None until the first baseline) and the records still
    owed."""

    def __init__(self, state_dir: StateDir | None = None) -> None:
        self._state_dir = state_dir
        self.serials: Slots | None = None
        self.pending: list[WireRecord] = []
        self._load()
        # after the load: None while the file there is of a newer format (never overwritten)
        self.path = state_dir.path(STATE_FILE) if state_dir else None

    def update(self, inventory: NodeInventory) -> list[SlotChange]:
        """What changed since the last inventory; remembers the slots to compare with next."""
        now = slots_of(inventory)
        if self.serials is not None:
            # a GPU still in its slot whose serial did not read this time keeps the old one
            unread = {(g.pci_bus_id or "").lower() for g in inventory.gpus if not g.serial}
            now.update((bus, s) for bus, s in self.serials.items() if bus in unread)
        if self.serials is None or not now:
            # no baseline yet, or NVML read no serial at all (a driver fault is no swap)
            self.serials = now or self.serials
            return []
        found, self.serials = changes(self.serials, now)
        return found

    # ---- state file ------------------------------------------------------------------------

    def _load(self) -> None:
        # unusable: set aside, and the next inventory is the baseline
        state = self._state_dir.load(STATE_FILE, _parse) if self._state_dir else None
        if state is not None:
            self.serials, self.pending = state

    def _write(self, path: Path) -> None:
        payload = orjson.dumps(
            formats.stamped(STATE_FILE, {"slots": self.serials or {}, "pending": self.pending}),
            option=orjson.OPT_SORT_KEYS,
        )
        write_atomically(path, payload)

    async def save(self) -> None:
        if self.path is not None:
            try:
                await asyncio.to_thread(self._write, self.path)
            except OSError as exc:
                _log.warning("cannot save hardware state", extra={"error": str(exc)})


def _parse(raw: bytes) -> tuple[Slots, list[WireRecord]]:
    state = orjson.loads(raw)
    formats.readable_format(STATE_FILE, state)  # format 1 is the only one so far
    slots = state["slots"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in slots.items()):
        raise ValueError("slots must map bus ids to serials")
    pending = [r for r in state.get("pending", []) if isinstance(r, dict)]
    return dict(slots), pending
