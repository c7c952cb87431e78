"""How each GPU's time and energy divide among its holders at one moment (the split), and the
keys accounting totals are kept under. Pure functions over a snapshot's parts; the
accountant (`accounting.py`) applies a split to the interval that follows it.

Per GPU the parts' `gpu_fraction` add up to at most 1; the rest is idle:
- a whole GPU: its holders share it, 1/N each, or in proportion to each holder's measured SM
  utilization where process attribution measured any (an idle shared GPU: 1/N again);
- a MIG GPU: each MIG device is the fraction of the GPU its profile's compute slices are
  (`3g.40gb` on a 7-slice GPU: 3/7; A30s have 4 slices), shared by its holders as a whole
  GPU is; a profile without a slice count counts 1/number of MIG devices. Slices not
  configured as MIG devices, and devices nobody holds, are idle.
`device_fraction` is the part of the device itself (a MIG device held alone: 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.attribution.shares import DeviceShares, ProcessView

# One holder (container) on one device: namespace, pod, pod UID, container, device UUID.
HoldingKey = tuple[str, str, str, str, str]
_SLICES = re.compile(r"^(\d+)g\.")
_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True, order=True)
class WorkloadKey:
    """What accounting totals are kept per: the top controller (owner walk), the DRA claim,
    the allow-listed pod labels; `pod` only in the per-pod variant. Without pod metadata the
    owner is unknown (""): such time counts per namespace."""

    namespace: str
    owner_kind: str
    owner_name: str
    claim: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    pod: str = ""


IDLE = WorkloadKey("", "", "")  # time and energy of GPUs (or their parts) nobody holds


def idle_holding(gpu_uuid: str) -> HoldingKey:
    """The holding a GPU's unheld time and energy are kept under (its idle usage records)."""
    return ("", "", "", "", gpu_uuid)


@dataclass(frozen=True, slots=True)
class Part:
    holding: HoldingKey
    workload: WorkloadKey
    gpu_fraction: float
    device_fraction: float


class Usage(NamedTuple):
    """Accumulated GPU-seconds (share-weighted physical GPUs), device-seconds (a MIG device or
    GPU held alone: 1 per second) and joules (None: no energy counter was ever read). A
    tuple: every snapshot copies each total, and tuples are the cheapest to make."""

    gpu_seconds: float = 0.0
    device_seconds: float = 0.0
    energy_joules: float | None = None


@dataclass(frozen=True, slots=True)
class AccountingView:
    """Totals since the agent started (holdings: since their state file), frozen per snapshot."""

    workloads: Mapping[WorkloadKey, Usage] = field(default_factory=lambda: _EMPTY)
    # per-pod variant (ACCOUNTING_PER_POD; off: empty)
    pods: Mapping[WorkloadKey, Usage] = field(default_factory=lambda: _EMPTY)
    holdings: Mapping[HoldingKey, Usage] = field(default_factory=lambda: _EMPTY)

    def holding(self, key: HoldingKey) -> Usage | None:
        return self.holdings.get(key)


NO_ACCOUNTING = AccountingView()


def holding_key(holder: Holder, device_uuid: str) -> HoldingKey:
    return (holder.namespace, holder.pod, holder.pod_uid, holder.container, device_uuid)


def mig_fractions(gpu: GpuIdentity) -> dict[str, float]:
    """Each MIG device's fraction of its GPU, from its profile's compute slices."""
    slices = 4 if gpu.name and "A30" in gpu.name else 7
    counts = [_SLICES.match(m.profile or "") for m in gpu.mig_devices]
    if not gpu.mig_devices:
        return {}
    if any(c is None for c in counts):
        return {m.uuid: 1 / len(gpu.mig_devices) for m in gpu.mig_devices}
    fractions = [int(c.group(1)) / slices for c in counts if c is not None]
    scale = max(1.0, sum(fractions))  # a profile table we do not know: never above the GPU
    return {m.uuid: f / scale for m, f in zip(gpu.mig_devices, fractions, strict=True)}


def _weights(holders: tuple[Holder, ...], shares: DeviceShares | None) -> list[float]:
    """Each holder's part of one device: measured SM share, or equal when nothing ran."""
    if shares is not None:
        measured: dict[tuple[str, str, str], float] = {}
        for share in shares.shares:
            h = share.holder
            if h is not None and share.sm_util:
                who = (h.namespace, h.pod, h.container)
                measured[who] = measured.get(who, 0.0) + share.sm_util
        sm = [measured.get((h.namespace, h.pod, h.container), 0.0) for h in holders]
        total = sum(sm)
        if total > 0:
            return [s / total for s in sm]
    return [1 / len(holders)] * len(holders)


def _claims(attribution: Attribution) -> dict[HoldingKey, str]:
    claims: dict[HoldingKey, str] = {}
    for a in attribution.allocations:
        if a.claim is not None:
            claims.setdefault(holding_key(a.holder, a.mig_uuid or a.gpu_uuid), a.claim.name)
    return claims


def workload_key(holder: Holder, claim: str) -> WorkloadKey:
    return WorkloadKey(
        holder.namespace, holder.workload_kind, holder.workload_name, claim, holder.labels
    )


def split_node(
    inventory: NodeInventory, attribution: Attribution, processes: ProcessView
) -> dict[str, tuple[Part, ...]]:
    """GPU UUID → its parts now (an empty tuple: nobody holds any of it)."""
    claims = _claims(attribution)
    out: dict[str, tuple[Part, ...]] = {}
    for gpu in inventory.gpus:
        devices = mig_fractions(gpu) if gpu.mig_devices else {gpu.uuid: 1.0}
        parts: list[Part] = []
        for uuid, fraction in devices.items():
            holders = attribution.holders(uuid)
            if not holders:
                continue
            for holder, weight in zip(
                holders, _weights(holders, processes.device(uuid)), strict=True
            ):
                key = holding_key(holder, uuid)
                parts.append(
                    Part(key, workload_key(holder, claims.get(key, "")), fraction * weight, weight)
                )
        out[gpu.uuid] = tuple(parts)
    return out
