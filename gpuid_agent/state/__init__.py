"""The node's state: one frozen snapshot per change, published on a bus no consumer can hold
up, and what must survive a restart (open allocations, the serial in each PCI slot)."""

from gpuid_agent.state.bus import SnapshotBus, Subscription
from gpuid_agent.state.snapshot import NodeSnapshot

__all__ = ["NodeSnapshot", "SnapshotBus", "Subscription"]
