"""The health state of every GPU over time: checks evaluated per collection and per XID.

The tracker keeps, per GPU (by UUID), each check's status with the moment it entered its state,
the windows the rate-based checks need, and the XIDs seen. `observe` and `record_xid` return the
transitions they caused, each exactly once: a check whose state and action stay the same is
not a transition, however often it is evaluated or however its wording changes.

What is reported is the last *judgement* (see `check_states`).

With the kernel log on (KERNEL_LOG) an XID arrives twice, as NVML event and kernel line:
`XidHistory` counts it once and lets the line's judgement replace the event's. The kernel log
also says when a GPU fell off the bus (`mark_off_bus`) and reports NVSwitch SXIDs (the node's
`nvswitch` check, `record_sxid`).

A GPU reset (see `resets`), a node reboot (the boot id changed since the state was saved)
or an operator's request (`clear`) clears the GPU's latched XIDs. `as_state` / `restore` carry
what must outlive the agent: latched XIDs with their boot id, the boots each XID was seen in,
the repeats within XID_REPEAT_WINDOW and the NVLinks seen up.

Runs on the event loop only (XIDs arrive from their thread through call_soon_threadsafe).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime import log
from gpuid_agent.sources.nvml.signals import GpuHealthSignals, XidEvent
from gpuid_agent.state.health import checks as rules
from gpuid_agent.state.health.check_states import CheckStates
from gpuid_agent.state.health.fabric import fabric_verdict
from gpuid_agent.state.health.gpu_state import GpuState
from gpuid_agent.state.health.nvlink_peers import NvLinkPeers, PeerInput, expectation, peer_views
from gpuid_agent.state.health.nvswitch import SwitchErrors
from gpuid_agent.state.health.recovery import NOT_REPORTED, recovery_verdict
from gpuid_agent.state.health.verdicts import GPU_CHECKS, NodeHealth, Transition, Verdict, worst
from gpuid_agent.state.health.xid import XidDetail
from gpuid_agent.state.health.xid_history import PAIR_WINDOW, Source

_log = log.get("health")


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
        kernel_log: bool = False,
    ) -> None:
        self.window = window
        self.xid_hold = xid_hold
        self.pcie_replay_threshold = pcie_replay_threshold
        self.xid_repeat_count = xid_repeat_count
        self.xid_repeat_window = xid_repeat_window
        self._clock = clock
        self._wall = wall
        self._gpus: dict[str, GpuState] = {}
        self._node = CheckStates()
        self._xid_unsupported: Mapping[int, str] = MappingProxyType({})
        self._xid_unavailable: str | None = None
        self._snapshot: NodeHealth | None = NodeHealth()
        self.boot_id = boot_id
        self._saved: dict[str, dict[str, Any]] = {}  # restored state of GPUs not seen yet
        self.unsaved = False  # what `as_state` gives changed since the last save
        self.kernel_log = kernel_log  # XIDs come from the kernel log too: pair them up
        self.switches = SwitchErrors(xid_hold)  # NVSwitch SXIDs, from the kernel log
        self._peers: Mapping[str, NvLinkPeers] = {}  # per GPU, this collection's NVLink peers

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
        self._peers = self._nvlink_peers(gpus, signals)
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
            if cleared := reset is not None and state.xids.clear():
                self.unsaved = True
                _log.info(
                    "GPU reset seen: latched XIDs cleared",
                    extra={"gpu": gpu.index, "uuid": gpu.uuid, "why": reset},
                )
            verdicts = self._gpu_verdicts(state, sig, lost_reason, now)
            by = "reset" if cleared else "reboot" if state.xids.take_rebooted() else ""
            transitions.extend(self._apply(state, verdicts, wall, by))
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
        self, event: XidEvent, detail: XidDetail | None = None, source: Source = "nvml"
    ) -> list[Transition]:
        """Count an XID and re-judge its GPU's XID check at once (not at the next tick). An
        XID of one MIG device names only that device's holders. `detail` and `source`
        "kernel": what a kernel line says of it (see `XidHistory` for the pairing)."""
        state = self._gpus.get(event.uuid)
        if state is None:
            return []
        now = self._clock()
        changed_state = state.xids.record(
            event.code,
            now,
            self.boot_id,
            detail=detail,
            recovery_field=state.recovery_field,
            source=source,
            wall=self._wall().timestamp(),
        )
        if changed_state is None:
            return []  # the kernel line already counted and judged it
        self._snapshot = None
        self.unsaved |= changed_state
        changed = self._apply(state, {"xid": self._xid_verdict(state, now)}, self._wall())
        if event.gpu_instance_id is None:
            return changed
        mig = (event.gpu_instance_id, event.compute_instance_id)
        return [dataclasses.replace(t, mig_instance=mig) for t in changed]

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

    def clear(self, selector: str) -> list[Transition]:
        """An operator's request: forget the latched and recent XIDs of the GPU whose UUID or
        index is `selector`. Returns the transitions; unknown selectors change nothing."""
        state = next((s for s in self._gpus.values() if selector in (s.uuid, str(s.index))), None)
        if state is None:
            return []
        self.unsaved |= state.xids.clear()
        self._snapshot = None
        verdict = {"xid": self._xid_verdict(state, self._clock())}
        return self._apply(state, verdict, self._wall(), "operator")

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

    def _new_gpu(self, gpu: GpuIdentity) -> GpuState:
        state = GpuState(
            gpu.uuid, gpu.index, gpu.serial, self.window, self.pcie_replay_threshold, gpu.name
        )
        state.xids.repeat_count = self.xid_repeat_count
        state.xids.repeat_window = self.xid_repeat_window
        state.xids.pair_window = PAIR_WINDOW if self.kernel_log else 0.0
        saved = self._saved.pop(gpu.uuid, None)
        if saved is not None:
            state.xids.restore(saved, self.boot_id, self._clock(), self._wall().timestamp())
            state.nvlink.seen_up.update(saved.get("nvlink_seen_up", ()))
        return state

    # ---- evaluation ----------------------------------------------------------------------

    def _xid_verdict(self, state: GpuState, now: float) -> Verdict:
        active = state.xids.active(now, self.xid_hold)
        unsupported = self._xid_unavailable or self._xid_unsupported.get(state.index)
        return rules.xid_verdict(active, unsupported)

    def _gpu_verdicts(
        self, state: GpuState, sig: GpuHealthSignals | None, lost: str | None, now: float
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

    def _recovery(self, state: GpuState, sig: GpuHealthSignals) -> Verdict:
        if sig.recovery_action is None:
            if "recovery_action" in sig.absent:
                state.recovery_field = False
                return Verdict("not_supported", NOT_REPORTED)
            return self._missing(sig, "recovery_action")
        state.recovery_field = True
        return recovery_verdict(sig.recovery_action)

    def _pcie(self, state: GpuState, sig: GpuHealthSignals, now: float) -> Verdict:
        if (state.pcie_link, state.pcie_aer) != (sig.pcie, sig.pcie_aer):
            state.pcie_link, state.pcie_aer = sig.pcie, sig.pcie_aer
            self._snapshot = None
        if sig.pcie is None:
            return self._missing(sig, "pcie_link")
        return state.pcie.verdict(sig.pcie, sig.pcie_replays, sig.utilization, now, sig.pcie_aer)

    def _nvlink_peers(
        self, gpus: Sequence[GpuIdentity], signals: Mapping[int, GpuHealthSignals]
    ) -> Mapping[str, NvLinkPeers]:
        def links(index: int) -> tuple[Any, ...] | None:
            sig = signals.get(index)
            return None if sig is None or sig.lost else sig.nvlinks

        return peer_views(
            [
                PeerInput(
                    g.uuid,
                    g.name,
                    links(g.index),
                    frozenset(s.nvlink.seen_up) if (s := self._gpus.get(g.uuid)) else frozenset(),
                )
                for g in gpus
            ]
        )

    def _nvlink(self, state: GpuState, sig: GpuHealthSignals, now: float) -> Verdict:
        links = sig.nvlinks or ()
        peers = self._peers.get(state.uuid)
        expected = expectation(state.nvlink.expected, peers, state.name) if links else None
        if state.nvlinks != links or state.nvlink_expected != expected:
            state.nvlinks, state.nvlink_expected = links, expected
            self._snapshot = None
        if sig.nvlinks is None:
            return self._missing(sig, "nvlink")
        seen = len(state.nvlink.seen_up)
        verdict = state.nvlink.verdict(sig.nvlinks, now, peers)
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

    def _ecc(self, state: GpuState, sig: GpuHealthSignals, now: float) -> Verdict:
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

    def _clock_events(self, state: GpuState, sig: GpuHealthSignals, now: float) -> Verdict:
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
        self, state: GpuState, verdicts: Mapping[str, Verdict], wall: datetime, by: str = ""
    ) -> list[Transition]:
        changed, dirty = state.states.apply(verdicts, wall)
        if dirty:
            self._snapshot = None
        if by == "reboot" and "xid" in verdicts and all(n != "xid" for n, _, _ in changed):
            changed.append(("xid", state.states.current["xid"], None))  # a quiet start: tell it
        if not changed:
            return []
        gpu_state, _ = worst(state.states.current.values())
        return [
            Transition(name, now, was, state.uuid, state.index, gpu_state, cleared_by=by or None)
            for name, now, was in changed
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
            gpus = [s.health() for s in sorted(self._gpus.values(), key=lambda g: g.index)]
            self._snapshot = NodeHealth(tuple(gpus), MappingProxyType(dict(self._node.current)))
        return self._snapshot


def _placeholder(index: int) -> GpuIdentity:
    return GpuIdentity(index=index, uuid=f"unknown-gpu-{index}")


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)
