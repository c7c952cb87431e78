"""What the health tracker keeps of one GPU: its checks' states, the windows the rate-based
checks need, its XIDs, what resets and the kernel log said, and its links as last read."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from gpuid_agent.sources.nvml.signals import NvLink, PcieAer, PcieLink
from gpuid_agent.state.health import checks as rules
from gpuid_agent.state.health.check_states import CheckStates
from gpuid_agent.state.health.links import NvLinkWatch, PcieWatch
from gpuid_agent.state.health.nvlink_models import expected_nvlinks
from gpuid_agent.state.health.resets import ResetWatch
from gpuid_agent.state.health.verdicts import GPU_CHECKS, GpuHealth, worst
from gpuid_agent.state.health.xid_history import XidHistory


@dataclass(slots=True)
class GpuState:
    """What the tracker knows of one GPU."""

    uuid: str
    index: int
    serial: str | None
    window: float
    replay_threshold: int = 0
    name: str | None = None  # NVML's model name: what NVLinks the GPU should have
    states: CheckStates = field(default_factory=CheckStates)
    ecc_corrected: rules.CounterWindow = field(init=False)
    ecc_uncorrected: rules.CounterWindow = field(init=False)
    clocks: rules.ReasonWindow = field(init=False)
    xids: XidHistory = field(default_factory=XidHistory)
    resets: ResetWatch = field(default_factory=ResetWatch)
    recovery_field: bool = True  # the driver reports field 230 (until a read says otherwise)
    off_bus: str | None = None  # the kernel said the GPU fell off the bus
    pcie: PcieWatch = field(init=False)
    nvlink: NvLinkWatch = field(init=False)
    pcie_link: PcieLink | None = None  # as last read, for /gpu/metrics and /status
    nvlinks: tuple[NvLink, ...] = ()
    nvlink_expected: str | None = None  # what the NVLinks are held to, for /status
    pcie_aer: PcieAer | None = None

    def __post_init__(self) -> None:
        self.ecc_corrected = rules.CounterWindow(self.window)
        self.ecc_uncorrected = rules.CounterWindow(self.window)
        self.clocks = rules.ReasonWindow(self.window)
        self.pcie = PcieWatch(self.window, self.replay_threshold)
        self.nvlink = NvLinkWatch(self.window, expected_nvlinks(self.name))

    def health(self) -> GpuHealth:
        """As shown on /status and /gpu/metrics: the checks in their fixed order."""
        current = self.states.current
        ordered = {n: current[n] for n in GPU_CHECKS if n in current}
        state, action = worst(ordered.values())
        return GpuHealth(
            index=self.index,
            uuid=self.uuid,
            serial=self.serial,
            state=state,
            action=action,
            checks=MappingProxyType(ordered),
            xid_counts=MappingProxyType(dict(self.xids.counts)),
            last_xid=self.xids.last,
            pcie=self.pcie_link,
            nvlinks=self.nvlinks,
            nvlink_expected=self.nvlink_expected,
            pcie_aer=self.pcie_aer,
        )
