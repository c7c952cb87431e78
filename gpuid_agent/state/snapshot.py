"""The node snapshot: everything the agent knows about its node at one moment, frozen.

The collector makes a new one after every NVML collection, every XID and every attribution
change, and publishes it on the `SnapshotBus`; every consumer (the /gpu/metrics renderer, the
reading emitter, the allocation trail, the node labeller, node conditions, health records)
reads the same object, so what is served, exported and labelled always agrees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from gpuid_agent.facts import GpuSample, NodeInventory
from gpuid_agent.state.accounting_split import NO_ACCOUNTING, AccountingView
from gpuid_agent.state.attribution.holders import Attribution
from gpuid_agent.state.attribution.shares import PROCESSES_OFF, ProcessView
from gpuid_agent.state.health.verdicts import NodeHealth, Transition

Cause = Literal["collection", "xid", "attribution"]


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    seq: int  # grows by one per snapshot; a consumer that sees a gap was coalesced
    cause: Cause
    inventory: NodeInventory
    samples: Mapping[str, GpuSample]
    health: NodeHealth
    attribution: Attribution
    # Health check transitions this snapshot brought (not carried over to the next one).
    transitions: tuple[Transition, ...] = ()
    # Pod metadata from the API is in (or the API is off): allocation ids are final.
    pods_ready: bool = True
    # per-process shares of each device (PROCESS_ATTRIBUTION; "off" otherwise)
    processes: ProcessView = PROCESSES_OFF
    # the GPU count NVML's is held to and where it came from (None, None: nothing to hold to)
    expected_gpus: tuple[int | None, str | None] = (None, None)
    # GPU-seconds and energy per workload and holding so far (state/accounting.py)
    accounting: AccountingView = NO_ACCOUNTING
    extra: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
