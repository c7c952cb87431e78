"""The vocabulary of GPU health: check states, suggested actions, verdicts and snapshots."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal, Protocol

from gpuid_agent.facts import HealthState, NvLink, PcieAer, PcieLink
from gpuid_agent.state.attribution.holders import Holder

CheckState = Literal["healthy", "degraded", "unhealthy", "not_supported", "unknown"]
# reset: a GPU reset (nvidia-smi -r) clears it; drain: stop peer-to-peer traffic to the GPU;
# reboot: the node (a reboot is also a GPU reset)
Action = Literal["none", "check_workload", "drain", "reset", "reboot", "hardware_inspection"]

CHECK_STATES: tuple[CheckState, ...] = (
    "healthy",
    "degraded",
    "unhealthy",
    "not_supported",
    "unknown",
)
ACTIONS: tuple[Action, ...] = (
    "none",
    "check_workload",
    "drain",
    "reset",
    "reboot",
    "hardware_inspection",
)

# Per-GPU checks, in the order /status and the metrics list them.
GPU_CHECKS = (
    "lost",
    "xid",
    "recovery",
    "ecc",
    "remapped_rows",
    "clock_events",
    "fabric",
    "persistence",
    "pcie",
    "nvlink",
)
NODE_CHECKS = ("gpu_count", "nvswitch")  # nvswitch: only with the kernel log

_SEVERITY: Mapping[str, int] = {"unhealthy": 2, "degraded": 1, "healthy": 0}
_ACTION_RANK: Mapping[str, int] = {a: i for i, a in enumerate(ACTIONS)}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one check concludes from one look at its signals."""

    state: CheckState
    reason: str | None = None
    action: Action = "none"


HEALTHY = Verdict("healthy")


@dataclass(frozen=True, slots=True)
class CheckStatus:
    """A check's current verdict and when its state (or action) last changed."""

    state: CheckState
    reason: str | None
    action: Action
    since: datetime

    @property
    def key(self) -> tuple[CheckState, Action]:
        """What a transition is: a change of state or of suggested action, not of wording."""
        return (self.state, self.action)

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "reason": self.reason,
            "action": self.action,
            "since": self.since.isoformat(),
        }


class Judged(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def action(self) -> Action: ...


def worst(statuses: Iterable[Judged]) -> tuple[HealthState, Action]:
    """Overall state and action: the most severe state, then the strongest action among it.

    Checks that are not supported or not known yet do not make a GPU unhealthy; a GPU whose
    every check is unknown is itself unknown.
    """
    items = list(statuses)
    judged = [s for s in items if s.state in _SEVERITY]
    if not judged:
        return ("unknown" if items else "healthy"), "none"
    top = max(_SEVERITY[s.state] for s in judged)
    state: HealthState = ("healthy", "degraded", "unhealthy")[top]
    actions = [s.action for s in judged if _SEVERITY[s.state] == top]
    return state, max(actions, key=lambda a: _ACTION_RANK[a])


@dataclass(frozen=True, slots=True)
class GpuHealth:
    index: int
    uuid: str
    serial: str | None
    state: HealthState
    action: Action
    checks: Mapping[str, CheckStatus]
    xid_counts: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    last_xid: int | None = None
    pcie: PcieLink | None = None  # the link as last read
    nvlinks: tuple[NvLink, ...] = ()
    pcie_aer: PcieAer | None = None  # the AER counters as last read
    nvlink_expected: str | None = None  # what the NVLinks are held to (table, peers or none)

    def as_dict(self) -> dict[str, Any]:
        links: dict[str, Any] = {}
        if self.pcie is not None:
            links["pcie"] = self.pcie._asdict()
        if self.nvlinks:
            links["nvlink_down"] = [lk.link for lk in self.nvlinks if not lk.active]
        if self.nvlink_expected is not None:
            links["nvlink_expected"] = self.nvlink_expected
        return {
            "index": self.index,
            "uuid": self.uuid,
            "serial": self.serial,
            "state": self.state,
            "action": self.action,
            "checks": {name: c.as_dict() for name, c in self.checks.items()},
            "xid_counts": {str(code): n for code, n in sorted(self.xid_counts.items())},
            **links,
        }


@dataclass(frozen=True, slots=True)
class NodeHealth:
    """One consistent view of every GPU's health and the node-level checks."""

    gpus: tuple[GpuHealth, ...] = ()
    node_checks: Mapping[str, CheckStatus] = field(default_factory=lambda: MappingProxyType({}))

    def by_uuid(self) -> dict[str, GpuHealth]:
        return {g.uuid: g for g in self.gpus}

    def as_dict(self) -> dict[str, Any]:
        state, action = worst([*(g for g in self.gpus), *self.node_checks.values()])
        return {
            "state": state,
            "action": action,
            "node": {name: c.as_dict() for name, c in self.node_checks.items()},
            "gpus": [g.as_dict() for g in self.gpus],
        }


@dataclass(frozen=True, slots=True)
class Transition:
    """A check changed state or action. `uuid` is None for node-level checks."""

    check: str
    current: CheckStatus
    previous: CheckStatus | None
    uuid: str | None = None
    index: int | None = None
    gpu_state: HealthState | None = None
    # who held the GPU (or one of its MIG devices) when it happened; joined by the collector
    holders: tuple[Holder, ...] = ()
    # an XID raised on one MIG device: (GPU instance, compute instance or None); its holders
    # are that device's only
    mig_instance: tuple[int, int | None] | None = None
    # the GPU's held XIDs were cleared in the same look: "reset" (seen through NVML) or
    # "operator" (`gpuid-agent health clear`); None otherwise
    cleared_by: str | None = None
