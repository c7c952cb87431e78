"""The kernel log judged: what a driver line means for a GPU (or the node's NVSwitches).

Imported only when KERNEL_LOG is set. A line names its GPU by PCI address, matched against
the inventory's bus ids. An XID line is the same XID as its NVML event (the tracker pairs
them and counts one) but says more, carried to `judge_xid` as its `XidDetail`: NVLink5 XIDs
are judged per row of NVIDIA's decode table, and the reason names the unit and link, XID 154's
new recovery action and the process the driver names. "Fallen off the bus" marks the GPU lost;
an NVSwitch SXID judges the node's `nvswitch` check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

from gpuid_agent.facts import NodeInventory
from gpuid_agent.runtime import log
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.kmsg.lines import (
    GpuOffBus,
    KernelEvent,
    KernelXid,
    NvSwitchSxid,
    PciAddress,
    pci_address,
)
from gpuid_agent.sources.kmsg.reader import KernelLogReader
from gpuid_agent.sources.nvml.signals import XidEvent
from gpuid_agent.state.health.nvlink5 import decode_bucket
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import Transition
from gpuid_agent.state.health.xid import XidDetail

_log = log.get("health.kernel_log")
RETRY_OPEN = 30.0  # seconds between attempts to open a log that could not be read


def xid_detail(line: KernelXid) -> XidDetail:
    """What the line adds to its XID code: the NVLink5 decode row's bucket, and its words."""
    words = []
    subcode = bucket = None
    if (n := line.nvlink) is not None:
        subcode, bucket = n.subcode, decode_bucket(line.code, n)
        where = f"link {n.link}" if n.link is not None else "no single link"
        severity = "fatal" if n.fatal else "non-fatal"
        row = bucket or "no decode row"
        words.append(f"{n.unit} {severity}, {where}, status 0x{n.error_status:08x}: {row}")
    if line.recovery_text:
        words.append(f"recovery action now {line.recovery_text}")
    if line.pid is not None or line.process:
        words.append(f"pid {line.pid if line.pid is not None else '?'} {line.process or ''}")
    text = "; ".join(w.strip() for w in words)
    return XidDetail(subcode, bucket, text or None, recovery_action=line.recovery_action)


class KernelLogWatch:
    def __init__(self, path: str, tracker: HealthTracker, board: StatusBoard) -> None:
        self.path = path
        self.tracker = tracker
        self._board = board
        self._unknown: set[PciAddress] = set()

    def judge(self, event: KernelEvent, inventory: NodeInventory | None) -> list[Transition]:
        if isinstance(event, NvSwitchSxid):
            if event.fatal is None:
                return []
            severity = "fatal" if event.fatal else "non-fatal"
            reason = f"NVSwitch {event.switch} ({event.pci}): SXID {event.code} {severity}"
            return self.tracker.record_sxid(event.fatal, f"{reason}: {event.text}")
        gpu = self._gpu(event.pci, inventory)
        if gpu is None:
            return []
        index, uuid = gpu
        if isinstance(event, GpuOffBus):
            return self.tracker.mark_off_bus(uuid, "GPU has fallen off the bus (kernel log)")
        xid = XidEvent(index=index, uuid=uuid, code=event.code, at=datetime.now(UTC))
        return self.tracker.record_xid(xid, xid_detail(event), source="kernel")

    def _gpu(self, pci: PciAddress, inventory: NodeInventory | None) -> tuple[int, str] | None:
        for g in inventory.gpus if inventory is not None else ():
            if g.pci_bus_id and pci_address(g.pci_bus_id) == pci:
                return g.index, g.uuid
        if pci not in self._unknown:  # once per address: a GPU NVML does not list
            self._unknown.add(pci)
            _log.warning("kernel log names a GPU not in the inventory", extra={"pci": str(pci)})
        return None

    async def follow(
        self,
        inventory: Callable[[], NodeInventory | None],
        publish: Callable[[list[Transition]], None],
    ) -> None:
        """Read the log until cancelled, publishing what each line changes; a log that
        cannot be opened or read is reported on /status and tried again."""

        def on_event(event: KernelEvent) -> None:
            transitions = self.judge(event, inventory())
            if transitions:
                publish(transitions)

        while True:
            reader = KernelLogReader(self.path, on_event)
            self._board.set("kernel_log", "ok")
            try:
                await reader.run()
            except OSError as exc:
                reason = f"cannot read {self.path}: {exc.strerror or exc}"
                self._board.set("kernel_log", "degraded", reason)  # logged by the board
            await asyncio.sleep(RETRY_OPEN)
