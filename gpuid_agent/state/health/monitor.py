"""GPU health in one place: the signals read each collection, the XID watcher, and the
tracker that judges them. The collector calls `check` once per collection and `record_xid`
per event; both return the check transitions, which travel in the next snapshot (health
records; logs once joined to the GPU's holders) while `snapshot()` is the current verdict
(/gpu/metrics, Node conditions). With STATE_DIR, what must outlive a restart is saved to
health.json after the collection that changed it, and operators' clear requests are taken
each collection (`health_file`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpuid_agent.facts import NodeInventory
from gpuid_agent.runtime import log
from gpuid_agent.runtime.status import StatusBoard
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.reader import NvmlReading
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.sources.nvml.xid import XidWatcher
from gpuid_agent.state.health.health_file import HealthFile, read_boot_id
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import NodeHealth, Transition
from gpuid_agent.state.health.xid import XidDetail
from gpuid_agent.state.state_file import StateDir

if TYPE_CHECKING:
    from gpuid_agent.state.health.kernel import KernelLogWatch

_log = log.get("health")
EXPECTED_CONFIGURED = "EXPECTED_GPU_COUNT"
EXPECTED_FROM_KUBELET = "kubelet allocatable"
EXPECTED_FROM_SLICES = "DRA ResourceSlices"
# The longest XID wait slice: what stopping the XID thread may take
XID_WAIT_MAX_MS = 2000.0


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """What the health checks are tuned by (HEALTH_WINDOW, XID_*, PCIE_REPLAY_THRESHOLD,
    EXPECTED_GPU_COUNT) and the collection interval the XID waits are sliced to."""

    window: float
    xid_hold: float
    pcie_replay_threshold: int
    xid_repeat_count: int
    xid_repeat_window: float
    expected_gpu_count: int  # -1: from the kubelet or the DRA ResourceSlices
    collect_interval: float
    state_dir: StateDir | None = None  # health.json and clear requests; None keeps nothing
    host_proc: str = "/proc"  # where the boot id is read
    kernel_log: str = ""  # KERNEL_LOG; empty: the kernel log is not read


class HealthMonitor:
    def __init__(
        self,
        config: HealthConfig,
        nvml: NvmlSource,
        board: StatusBoard,
        on_xid: Callable[[XidEvent], None],
    ) -> None:
        self.file = HealthFile(config.state_dir)
        self.tracker = HealthTracker(
            window=config.window,
            xid_hold=config.xid_hold,
            pcie_replay_threshold=config.pcie_replay_threshold,
            xid_repeat_count=config.xid_repeat_count,
            xid_repeat_window=config.xid_repeat_window,
            boot_id=read_boot_id(config.host_proc) if self.file.path else None,
            kernel_log=bool(config.kernel_log),
        )
        self.tracker.restore(self.file.load())
        self._said_no_recovery = False
        self.kernel: KernelLogWatch | None = None
        if config.kernel_log:  # imported only when asked for: off costs nothing
            from gpuid_agent.state.health.kernel import KernelLogWatch

            self.kernel = KernelLogWatch(config.kernel_log, self.tracker, board)
        self.reader = HealthReader(nvml.reader.api)
        # XID waits are sliced to the collection interval (50 ms..2 s): the slice bounds how
        # long stopping the XID thread takes (the agent asks it to stop as its shutdown
        # begins, and waits at most 2 s for it at the end), and each slice is a wake-up.
        wait_ms = int(min(XID_WAIT_MAX_MS, max(50.0, config.collect_interval * 1000)))
        self.xid = XidWatcher(nvml.reader.api, on_xid, wait_ms=wait_ms)
        self._expected = config.expected_gpu_count
        self._board = board
        self.expected: tuple[int | None, str | None] = (None, None)  # (count, where from)

    def snapshot(self) -> NodeHealth:
        return self.tracker.snapshot()

    async def check(
        self,
        inventory: NodeInventory,
        reading: NvmlReading,
        nvml: NvmlSource,
        allocatable: int | None,
        dra_gpus: int | None = None,
    ) -> tuple[dict[int, GpuHealthSignals], list[Transition]]:
        readable = {g.index: g.uuid for g in inventory.gpus if g.index not in reading.lost}
        signals = with_telemetry(
            await nvml.run(lambda: self.reader.read(readable), "health read"), reading
        )
        self.xid.watch(readable)
        self.expected = expected, source = self.expected_count(allocatable, dra_gpus)
        transitions = self.tracker.observe(
            inventory.gpus,
            signals,
            reading.lost,
            expected_gpus=expected,
            expected_source=source or "",
            xid_unsupported=self.xid.unsupported,
            xid_unavailable=self.xid.unavailable,
        )
        transitions.extend(await self._operator_clears())
        self._note_recovery_field(signals)
        if self.tracker.unsaved and self.file.path is not None:
            self.tracker.unsaved = False
            await asyncio.to_thread(self.file.save, self.tracker.as_state())
        if self.xid.unavailable:
            self._board.set("health", "degraded", self.xid.unavailable)
        else:
            self._board.set("health", "ok")
        return signals, transitions

    async def _operator_clears(self) -> list[Transition]:
        if self.file.clear_dir is None:
            return []
        transitions: list[Transition] = []
        for selector in await asyncio.to_thread(self.file.take_clear_requests):
            cleared = self.tracker.clear(selector)
            known = any(selector in (g.uuid, str(g.index)) for g in self.snapshot().gpus)
            _log.warning(
                "GPU health cleared by an operator" if known else "clear request: no such GPU",
                extra={"gpu": selector, "transitions": len(cleared)},
            )
            transitions.extend(cleared)
        return transitions

    def _note_recovery_field(self, signals: dict[int, GpuHealthSignals]) -> None:
        """Say once that the driver lacks the recovery action field (the recovery check on
        /status says it per GPU)."""
        if self._said_no_recovery:
            return
        lacking = [i for i, sig in signals.items() if "recovery_action" in sig.absent]
        if lacking:
            self._said_no_recovery = True
            _log.info(
                "the driver does not report GPU recovery actions (NVML field 230): "
                "XID 154 is judged by the catalogue",
                extra={"gpus": lacking},
            )

    def expected_count(
        self, allocatable: int | None, dra_gpus: int | None
    ) -> tuple[int | None, str | None]:
        """The GPU count NVML's is held to, and where it came from: EXPECTED_GPU_COUNT, else
        the device plugin's allocatable GPUs, else (a node that gets its GPUs only through
        DRA, where the device plugin reports none) the DRA driver's ResourceSlices."""
        if self._expected >= 0:
            return self._expected, EXPECTED_CONFIGURED
        if not allocatable and dra_gpus:
            return dra_gpus, EXPECTED_FROM_SLICES
        if allocatable is None:
            return None, None
        return allocatable, EXPECTED_FROM_KUBELET

    async def close(self, within: float) -> None:
        """Stop the XID thread, waiting at most `within` seconds on the loop (the thread is a
        daemon: a wait hung in the driver is left to the interpreter's exit)."""
        if not await self.xid.stop_within(within):
            _log.warning("XID thread still waiting at shutdown")

    def record_xid(self, event: XidEvent, detail: XidDetail | None = None) -> list[Transition]:
        return self.tracker.record_xid(event, detail)


def with_telemetry(
    signals: dict[int, GpuHealthSignals], reading: NvmlReading
) -> dict[int, GpuHealthSignals]:
    """Signals plus what the telemetry read already has and the link check needs (busy
    percent, PCIe replays), so no NVML call is made twice per collection."""
    merged = {}
    for index, sig in signals.items():
        sample = reading.samples.get(sig.uuid)
        values = sample.values if sample is not None else {}
        replays, util = values.get("pcie_replay"), values.get("gpu_util")
        merged[index] = dataclasses.replace(
            sig,
            pcie_replays=None if replays is None else int(replays),
            utilization=util,
        )
    return merged


def log_transitions(transitions: Iterable[Transition]) -> None:
    """One log line per transition, naming who held the GPU (the collector logs them once
    they are joined to their holders)."""
    for t in transitions:
        level = 30 if t.current.state in ("degraded", "unhealthy") else 20
        _log.log(
            level,
            f"GPU health: {t.check} is {t.current.state}",
            extra={
                "gpu": t.index,
                "uuid": t.uuid,
                "check": t.check,
                "previous": t.previous.state if t.previous else None,
                "reason": t.current.reason,
                "action": t.current.action,
                "holders": [f"{h.namespace}/{h.pod}/{h.container}" for h in t.holders],
            },
        )
