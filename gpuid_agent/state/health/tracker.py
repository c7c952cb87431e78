"""The health state of every GPU over time: checks evaluated per collection and per XID.

The tracker keeps, per GPU (by UUID), each check's status with the moment it entered its state,
the windows the rate-based checks need, and the XIDs seen. `observe` and `record_xid` return the
transitions they caused, each exactly once: a check whose state and action stay the same is
not a transition, however often it is evaluated or however its wording changes.

What is reported is the last *judgement* (see `check_states`).

A GPU reset (see `resets`), a node reboot (the boot id changed since the state was saved)
or an operator's request (`clear`) clears the GPU's latched XIDs. `as_state` / `restore` carry
what must outlive the agent: latched XIDs with their boot id, the boots each XID was seen in,
and the NVLinks seen up.

Runs on the event loop only (XIDs arrive from their thread through call_soon_threadsafe).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime import log
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, NvLink, PcieLink, XidEvent
from gpuid_agent.state.health import checks as rules
from gpuid_agent.state.health.check_states import CheckStates
from gpuid_agent.state.health.fabric import fabric_verdict
from gpuid_agent.state.health.links import NvLinkWatch, PcieWatch
from gpuid_agent.state.health.recovery import NOT_REPORTED, recovery_verdict
from gpuid_agent.state.health.resets import ResetWatch
from gpuid_agent.state.health.verdicts import (
    GPU_CHECKS,
    GpuHealth,
    NodeHealth,
    Transition,
    Verdict,
    worst,
)
from gpuid_agent.state.health.xid import XidDetail
from gpuid_agent.state.health.xid_history import XidHistory

_log = log.get("health")


@dataclass(slots=True)
class _Gpu:
    uuid: str
    index: int
    serial: str | None
    window: float
    replay_threshold: int = 0
    states: CheckStates = field(default_factory=CheckStates)
    ecc_corrected: rules.CounterWindow = field(init=False)
    ecc_uncorrected: rules.CounterWindow = field(init=False)
    clocks: rules.ReasonWindow = field(init=False)
    xids: XidHistory = field(default_factory=XidHistory)
    resets: ResetWatch = field(default_factory=ResetWatch)
    recovery_field: bool = True  # the driver reports field 230 (until a read says otherwise)
    pcie: PcieWatch = field(init=False)
    nvlink: NvLinkWatch = field(init=False)
    pcie_link: PcieLink | None = None  # as last read, for /gpu/metrics and /status
    nvlinks: tuple[NvLink, ...] = ()

    def __post_init__(self) -> None:
        self.ecc_corrected = rules.CounterWindow(self.window)
        self.ecc_uncorrected = rules.CounterWindow(self.window)
        self.clocks = rules.ReasonWindow(self.window)
        self.pcie = PcieWatch(self.window, self.replay_threshold)
        self.nvlink = NvLinkWatch(self.window)


class HealthTracker:
    def __init__(
        self,
        *,
        window: float = 300.0,
        xid_hold: float = 600.0,
        pcie_replay_threshold: int = 0,
        xid_repeat_count: int = 0,
        xid_repeat_window: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
        boot_id: str | None = None,
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
        self.boot_id = boot_id
        self._saved: dict[str, dict[str, Any]] = {}  # restored state of GPUs not seen yet
        self.unsaved = False  # what `as_state` gives changed since the last save

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
                    state = self._new_gpu(gpu)
                self._gpus[gpu.uuid] = state
                self._snapshot = None
            elif (state.index, state.serial) != (gpu.index, gpu.serial):
                state.index, state.serial = gpu.index, gpu.serial
                self._snapshot = None
            sig = signals.get(gpu.index)
            lost_reason = lost.get(gpu.index) or (sig.lost if sig else None)
            if lost_reason is not None:
                unusable += 1
            reset = state.resets.observe(sig, lost_reason)
            if reset is not None and state.xids.clear():
                self.unsaved = True
                _log.info(
                    "GPU reset seen: latched XIDs cleared",
                    extra={"gpu": gpu.index, "uuid": gpu.uuid, "why": reset},
                )
            verdicts = self._gpu_verdicts(state, sig, lost_reason, now)
            transitions.extend(self._apply(state, verdicts, wall))
        present = {g.uuid for g in gpus}
        for uuid in [u for u in self._gpus if u not in present]:
            del self._gpus[uuid]  # gone from the node: the count check speaks for it
            self._snapshot = None
        usable = len(gpus) - unusable
        count = rules.gpu_count_verdict(usable, expected_gpus, expected_source)
        transitions.extend(self._apply_node({"gpu_count": count}, wall))
        return transitions

    def record_xid(self, event: XidEvent, detail: XidDetail | None = None) -> list[Transition]:
        """Count an XID and re-judge its GPU's XID check at once (not at the next tick). An
        XID of one MIG device names only that device's holders."""
        state = self._gpus.get(event.uuid)
        if state is None:
            return []
        self._snapshot = None
        now = self._clock()
        if state.xids.record(
            event.code, now, self.boot_id, detail=detail, recovery_field=state.recovery_field
        ):
            self.unsaved = True
        changed = self._apply(state, {"xid": self._xid_verdict(state, now)}, self._wall())
        if event.gpu_instance_id is None:
            return changed
        mig = (event.gpu_instance_id, event.compute_instance_id)
        return [dataclasses.replace(t, mig_instance=mig) for t in changed]

    def clear(self, selector: str) -> list[Transition]:
        """An operator's request: forget the latched and recent XIDs of the GPU whose UUID or
        index is `selector`. Returns the transitions; unknown selectors change nothing."""
        state = next((s for s in self._gpus.values() if selector in (s.uuid, str(s.index))), None)
        if state is None:
            return []
        if state.xids.clear():
            self.unsaved = True
        self._snapshot = None
        return self._apply(state, {"xid": self._xid_verdict(state, self._clock())}, self._wall())

    # ---- across restarts -----------------------------------------------------------------

    def as_state(self) -> dict[str, Any]:
        """What a restarted agent takes back (see `restore`); GPUs not seen in this run keep
        what was restored for them."""
        gpus = dict(self._saved)
        for s in self._gpus.values():
            if s.uuid.startswith("unknown-gpu-"):
                continue
            gpus[s.uuid] = {
                **s.xids.as_state(self.boot_id),
                "nvlink_seen_up": sorted(s.nvlink.seen_up),
            }
        return {"boot_id": self.boot_id, "gpus": gpus}

    def restore(self, gpus: Mapping[str, Mapping[str, Any]]) -> None:
        """Saved per-GPU state, applied as each GPU is first seen (validated by the reader)."""
        self._saved = {uuid: dict(saved) for uuid, saved in gpus.items()}

    def _new_gpu(self, gpu: GpuIdentity) -> _Gpu:
        state = _Gpu(gpu.uuid, gpu.index, gpu.serial, self.window, self.pcie_replay_threshold)
        state.xids.repeat_count = self.xid_repeat_count
        state.xids.repeat_window = self.xid_repeat_window
        saved = self._saved.pop(gpu.uuid, None)
        if saved is not None:
            state.xids.restore(saved, self.boot_id)
            state.nvlink.seen_up.update(saved.get("nvlink_seen_up", ()))
        return state

    # ---- evaluation ----------------------------------------------------------------------

    def _xid_verdict(self, state: _Gpu, now: float) -> Verdict:
        active = state.xids.active(now, self.xid_hold)
        unsupported = self._xid_unavailable or self._xid_unsupported.get(state.index)
        return rules.xid_verdict(active, unsupported)

    def _gpu_verdicts(
        self, state: _Gpu, sig: GpuHealthSignals | None, lost: str | None, now: float
    ) -> dict[str, Verdict]:
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
        verdicts["recovery"] = self._recovery(state, sig)
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

    def _recovery(self, state: _Gpu, sig: GpuHealthSignals) -> Verdict:
        if sig.recovery_action is None:
            if "recovery_action" in sig.absent:
                state.recovery_field = False
                return Verdict("not_supported", NOT_REPORTED)
            return self._missing(sig, "recovery_action")
        state.recovery_field = True
        return recovery_verdict(sig.recovery_action)

    def _pcie(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        if state.pcie_link != sig.pcie:
            state.pcie_link = sig.pcie
            self._snapshot = None
        if sig.pcie is None:
            return self._missing(sig, "pcie_link")
        return state.pcie.verdict(sig.pcie, sig.pcie_replays, sig.utilization, now)

    def _nvlink(self, state: _Gpu, sig: GpuHealthSignals, now: float) -> Verdict:
        links = sig.nvlinks or ()
        if state.nvlinks != links:
            state.nvlinks = links
            self._snapshot = None
        if sig.nvlinks is None:
            return self._missing(sig, "nvlink")
        seen = len(state.nvlink.seen_up)
        verdict = state.nvlink.verdict(sig.nvlinks, now)
        if len(state.nvlink.seen_up) != seen:
            self.unsaved = True
        return verdict

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
                        xid_counts=MappingProxyType(dict(s.xids.counts)),
                        last_xid=s.xids.last,
                        pcie=s.pcie_link,
                        nvlinks=s.nvlinks,
                    )
                )
            self._snapshot = NodeHealth(tuple(gpus), MappingProxyType(dict(self._node.current)))
        return self._snapshot


def _placeholder(index: int) -> GpuIdentity:
    return GpuIdentity(index=index, uuid=f"unknown-gpu-{index}")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)
