"""The health state of every GPU over time: checks evaluated per collection and per XID.

The tracker keeps, per GPU (by UUID), each check's status with the moment it entered its state,
the windows the rate-based checks need, and the XIDs seen. `observe` and `record_xid` return the
transitions they caused, each exactly once: a check whose state and action stay the same is
not a transition, however often it is evaluated or however its wording changes.

What is reported is the last *judgement*: a check that cannot be judged for a while ("unknown")
is shown as such but not reported, so unhealthy → unknown → unhealthy is no news and
unhealthy → unknown → healthy is one transition, unhealthy → healthy. A check that starts out
healthy or not supported is not news either.

Runs on the event loop only (XIDs arrive from their thread through call_soon_threadsafe).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, NvLink, PcieAer, PcieLink, XidEvent
from gpuid_agent.state.health import checks as rules
from gpuid_agent.state.health.check_states import CheckStates
from gpuid_agent.state.health.fabric import fabric_verdict
from gpuid_agent.state.health.links import NvLinkWatch, PcieWatch
from gpuid_agent.state.health.nvlink_models import expected_nvlinks
from gpuid_agent.state.health.nvswitch import SwitchErrors
from gpuid_agent.state.health.verdicts import (
    GPU_CHECKS,
    GpuHealth,
    NodeHealth,
    Transition,
    Verdict,
    worst,
)
from gpuid_agent.state.health.xid import XidClass, classify_xid, escalate


@dataclass(slots=True)
class _Gpu:
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
    xid_counts: Counter[int] = field(default_factory=Counter)
    last_xid: int | None = None
    latches: list[XidClass] = field(default_factory=list)
    recent: list[tuple[float, XidClass]] = field(default_factory=list)
    # XIDs counted from one source (NVML event, kernel log line) that the other may still
    # report: (when, source, class judged)
    unpaired: list[tuple[float, str, XidClass]] = field(default_factory=list)
    off_bus: str | None = None  # the kernel said the GPU fell off the bus
    xid_times: dict[int, deque[float]] = field(default_factory=dict)  # per code, for repeats
    pcie: PcieWatch = field(init=False)
    nvlink: NvLinkWatch = field(init=False)
    pcie_link: PcieLink | None = None  # as last read, for /gpu/metrics and /status
    nvlinks: tuple[NvLink, ...] = ()
    pcie_aer: PcieAer | None = None

    def __post_init__(self) -> None:
        self.ecc_corrected = rules.CounterWindow(self.window)
        self.ecc_uncorrected = rules.CounterWindow(self.window)
        self.clocks = rules.ReasonWindow(self.window)
        self.pcie = PcieWatch(self.window, self.replay_threshold)
        self.nvlink = NvLinkWatch(self.window, expected_nvlinks(self.name))

    @property
    def latched(self) -> XidClass | None:
        return rules.worst_xid(self.latches)


# An NVML event and a kernel log line of the same XID on the same GPU this close are one XID
PAIR_WINDOW = 5.0


class HealthTracker:
    def __init__(
        self,
        *,
        window: float = 300.0,
        xid_hold: float = 600.0,
        pcie_replay_threshold: int = 0,
        xid_repeat_count: int = 0,
        xid_repeat_window: float = 3600.0,
        kernel_log: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.window = window
        self.xid_hold = xid_hold
        self.pcie_replay_threshold = pcie_replay_threshold
        self.xid_repeat_count = xid_repeat_count
        self.xid_repeat_window = xid_repeat_window
        self._clock = clock
        self._wall = wall
        self._gpus: dict[str, _Gpu] = {}
        self._node = CheckStates()
        self._xid_unsupported: Mapping[int, str] = MappingProxyType({})
        self._xid_unavailable: str | None = None
        self._snapshot: NodeHealth | None = NodeHealth()
        self.kernel_log = kernel_log  # XIDs come from the kernel log too: pair them up
        self.switches = SwitchErrors(xid_hold)  # NVSwitch SXIDs, from the kernel log

    # ---- inputs --------------------------------------------------------------------------

    def observe(
        self,
        gpus: Sequence[GpuIdentity],
        signals: Mapping[int, GpuHealthSignals],
        lost: Mapping[int, str],
        *,
        expected_gpus: int | None = None,
        expected_source: str = "configured",
        xid_unsupported: Mapping[int, str] | None = None,
        xid_unavailable: str | None = None,
    ) -> list[Transition]:
        """Evaluate every check of every GPU from one collection's readings."""
        now, wall = self._clock(), self._wall()
        self._xid_unsupported = MappingProxyType(dict(xid_unsupported or {}))
        self._xid_unavailable = xid_unavailable
        transitions: list[Transition] = []
        known = {g.index for g in gpus}
        # A GPU lost before it was ever read has no identity: it is shown (and counted) under
        # a placeholder until it is read, and then its state moves to its real UUID.
        gpus = [*gpus, *(_placeholder(i) for i in sorted(lost) if i not in known)]
        unusable = 0
        for gpu in gpus:
            state = self._gpus.get(gpu.uuid)
            if state is None:
                state = self._gpus.pop(_placeholder(gpu.index).uuid, None)
                if state is not None:
                    state.uuid, state.serial = gpu.uuid, gpu.serial
                else:
                    state = _Gpu(
                        gpu.uuid,
                        gpu.index,
                        gpu.serial,
                        self.window,
                        self.pcie_replay_threshold,
                        gpu.name,
                    )
                self._gpus[gpu.uuid] = state
                self._snapshot = None
            elif (state.index, state.serial) != (gpu.index, gpu.serial):
                state.index, state.serial = gpu.index, gpu.serial
                self._snapshot = None
            sig = signals.get(gpu.index)
            lost_reason = lost.get(gpu.index) or (sig.lost if sig else None)
            if lost_reason is not None:
                unusable += 1
            verdicts = self._gpu_verdicts(state, sig, lost_reason, now)
            transitions.extend(self._apply(state, verdicts, wall))
        present = {g.uuid for g in gpus}
        for uuid in [u for u in self._gpus if u not in present]:
            del self._gpus[uuid]  # gone from the node: the count check speaks for it
            self._snapshot = None
        usable = len(gpus) - unusable
        node = {"gpu_count": rules.gpu_count_verdict(usable, expected_gpus, expected_source)}
        if self.kernel_log:
            node["nvswitch"] = self.switches.verdict(now)
        transitions.extend(self._apply_node(node, wall))
        return transitions

    def record_xid(
        self, event: XidEvent, judged: XidClass | None = None, source: str = "nvml"
    ) -> list[Transition]:
        """Count an XID and re-judge its GPU's XID check at once (not at the next tick).

        With the kernel log on, the same XID arrives twice, as an NVML event and as a kernel
        line (`source` "kernel", `judged` from what the line says): whichever comes second
        within PAIR_WINDOW is not counted again, and a line's judgement replaces the event's.
        """
        state = self._gpus.get(event.uuid)
        if state is None:
            return []
        now = self._clock()
        cls = judged or classify_xid(event.code)
        paired = self._pair(state, source, cls, now)
        if paired is not None and source != "kernel":
            return []  # the kernel line already counted and judged it
        if paired is not None:  # take back what the event's judgement added
            state.latches = [c for c in state.latches if c is not paired]
            state.recent = [(t, c) for t, c in state.recent if c is not paired]
        else:
            state.xid_counts[event.code] += 1
            state.last_xid = event.code
        self._snapshot = None
        cls = self._repeated(state, cls, counted=paired is None)
        if paired is None and self.kernel_log:  # as judged, so its twin can take it back
            state.unpaired.append((now, source, cls))
        if cls.state != "healthy":
            if cls.latched:
                state.latches.append(cls)
            else:
                state.recent.append((now, cls))
        verdict = self._xid_verdict(state, now)
        return self._apply(state, {"xid": verdict}, self._wall())

    @staticmethod
    def _pair(state: _Gpu, source: str, cls: XidClass, now: float) -> XidClass | None:
        """The class an XID from the other source was given, if it is this one's twin."""
        state.unpaired = [u for u in state.unpaired if now - u[0] < PAIR_WINDOW]
        for i, (_, other, seen) in enumerate(state.unpaired):
            if other != source and seen.code == cls.code:
                del state.unpaired[i]
                return seen
        return None

    def mark_off_bus(self, uuid: str, reason: str) -> list[Transition]:
        """The kernel says the GPU fell off the bus: lost until the agent restarts."""
        state = self._gpus.get(uuid)
        if state is None or state.off_bus is not None:
            return []
        state.off_bus = reason
        return self._apply(state, {"lost": rules.lost_verdict(reason)}, self._wall())

    def record_sxid(self, fatal: bool, reason: str) -> list[Transition]:
        """An NVSwitch error from the kernel log, judged at once."""
        now = self._clock()
        self.switches.add(now, fatal, reason)
        return self._apply_node({"nvswitch": self.switches.verdict(now)}, self._wall())

    def _repeated(self, state: _Gpu, cls: XidClass, counted: bool = True) -> XidClass:
        """`cls`, one action step stronger once its code repeated often enough."""
        now = self._clock()
        seen = state.xid_times.setdefault(cls.code, deque())
        if counted:
            seen.append(now)
        while seen and seen[0] <= now - self.xid_repeat_window:
            seen.popleft()
        if self.xid_repeat_count <= 0 or len(seen) < self.xid_repeat_count:
            return cls
        return escalate(cls, len(seen), rules.format_window(self.xid_repeat_window))

    # ---- evaluation ----------------------------------------------------------------------

    def _xid_verdict(self, state: _Gpu, now: float) -> Verdict:
        state.recent = [(t, c) for t, c in state.recent if now - t < self.xid_hold]
        active = rules.worst_xid([*state.latches, *(c for _, c in state.recent)])
        unsupported = self._xid_unavailable or self._xid_unsupported.get(state.index)
        return rules.xid_verdict(active, unsupported)

    def _gpu_verdicts(
        self, state: _Gpu, sig: GpuHealthSignals | None, lost: str | None, now: float
    ) -> dict[str, Verdict]:
        lost = lost or state.off_bus
        verdicts: dict[str, Verdict] = {
            "lost": rules.lost_verdict(lost),
            "xid": self._xid_verdict(state, now),
        }
        if lost is not None or sig is None:
            # Unreadable: the other checks keep what they last knew (one fault, one transition)
            unread = Verdict("unknown", "GPU unreadable")
            for name in GPU_CHECKS:
                if name not in verdicts and name not in state.states.current:
                    verdicts[name] = unread
            return verdicts
        verdicts["ecc"] = self._ecc(state, sig, now)
        verdicts["remapped_rows"] = self._signal(
            sig, "remapped_rows", sig.remapped_rows, rules.remapped_rows_verdict
        )
        verdicts["clock_events"] = self._clock_events(state, sig, now)
        verdicts["fabric"] = self._signal(sig, "fabric", sig.fabric, fabric_verdict)
        verdicts["persistence"] = self._signal(
            sig, "persistence_mode", sig.persistence_mode, rules.persistence_verdict
        )
        verdicts["pcie"] = self._pcie(state, sig, now)
        verdicts["nvlink"] = self._nvlink(state, sig, now)
        return verdicts

    def _pcie(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        if (state.pcie_link, state.pcie_aer) != (sig.pcie, sig.pcie_aer):
            state.pcie_link, state.pcie_aer = sig.pcie, sig.pcie_aer
            self._snapshot = None
        if sig.pcie is None:
            return self._missing(sig, "pcie_link")
        return state.pcie.verdict(sig.pcie, sig.pcie_replays, sig.utilization, now, sig.pcie_aer)

    def _nvlink(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        links = sig.nvlinks or ()
        if state.nvlinks != links:
            state.nvlinks = links
            self._snapshot = None
        if sig.nvlinks is None:
            return self._missing(sig, "nvlink")
        return state.nvlink.verdict(sig.nvlinks, now)

    @staticmethod
    def _missing(sig: GpuHealthSignals, name: str) -> Verdict:
        if name in sig.failed:
            return Verdict("unknown", sig.failed[name])
        return Verdict("not_supported", sig.absent.get(name, "not reported"))

    def _signal(
        self,
        sig: GpuHealthSignals,
        name: str,
        value: object,
        judge: Callable[..., Verdict],
    ) -> Verdict:
        return self._missing(sig, name) if value is None else judge(value)

    def _ecc(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        ecc = sig.ecc
        if ecc is None and not sig.retired_pages_pending:
            return self._missing(sig, "ecc")
        if ecc is not None:
            corrected = _first(ecc.volatile_corrected, ecc.aggregate_corrected)
            uncorrected = _first(ecc.volatile_uncorrected, ecc.aggregate_uncorrected)
            if corrected is not None:
                state.ecc_corrected.add(now, corrected)
            if uncorrected is not None:
                state.ecc_uncorrected.add(now, uncorrected)
        return rules.ecc_verdict(
            ecc,
            sig.retired_pages_pending,
            corrected_growth=state.ecc_corrected.growth(),
            uncorrected_growth=state.ecc_uncorrected.growth(),
            window=self.window,
        )

    def _clock_events(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        mask = sig.clocks_event_reasons
        if mask is None:
            return self._missing(sig, "clocks_event_reasons")
        try:
            state.clocks.add(now, mask)
        except ValueError as exc:
            return Verdict("unknown", str(exc))
        return rules.clock_events_verdict(state.clocks)

    # ---- transitions ---------------------------------------------------------------------

    def _apply(
        self, state: _Gpu, verdicts: Mapping[str, Verdict], wall: datetime
    ) -> list[Transition]:
        changed, dirty = state.states.apply(verdicts, wall)
        if dirty:
            self._snapshot = None
        if not changed:
            return []
        gpu_state, _ = worst(state.states.current.values())
        return [
            Transition(name, current, previous, state.uuid, state.index, gpu_state)
            for name, current, previous in changed
        ]

    def _apply_node(self, verdicts: Mapping[str, Verdict], wall: datetime) -> list[Transition]:
        changed, dirty = self._node.apply(verdicts, wall)
        if dirty:
            self._snapshot = None
        return [Transition(name, current, previous) for name, current, previous in changed]

    # ---- output --------------------------------------------------------------------------

    def snapshot(self) -> NodeHealth:
        """The current health of the node (rebuilt only after something changed)."""
        if self._snapshot is None:
            gpus = []
            for s in sorted(self._gpus.values(), key=lambda g: g.index):
                current = s.states.current
                ordered = {n: current[n] for n in GPU_CHECKS if n in current}
                state, action = worst(ordered.values())
                gpus.append(
                    GpuHealth(
                        index=s.index,
                        uuid=s.uuid,
                        serial=s.serial,
                        state=state,
                        action=action,
                        checks=MappingProxyType(ordered),
                        xid_counts=MappingProxyType(dict(s.xid_counts)),
                        last_xid=s.last_xid,
                        pcie=s.pcie_link,
                        nvlinks=s.nvlinks,
                        pcie_aer=s.pcie_aer,
                    )
                )
            self._snapshot = NodeHealth(tuple(gpus), MappingProxyType(dict(self._node.current)))
        return self._snapshot


def _placeholder(index: int) -> GpuIdentity:
    return GpuIdentity(index=index, uuid=f"unknown-gpu-{index}")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)
