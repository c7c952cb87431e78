"""Telling that a GPU was reset, from what NVML shows between two collections.

NVML has no reset counter, so a reset is inferred from what only a reset (or a reboot, which
is one) changes:

- the GPU answers again after being lost (GPU_IS_LOST / RESET_REQUIRED, or gone from the
  enumeration: a re-enumerated GPU starts with no state at all);
- the driver's recovery action (field 230) goes from an action back to NONE: the recovery it
  asked for happened;
- a pending row remap (or page retirement) is no longer pending: remaps apply at reset.

A reset clears the GPU's latched XIDs; a node reboot does the same through the boot id.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuid_agent.sources.nvml.signals import GpuHealthSignals
from gpuid_agent.state.health.recovery import NONE


@dataclass(slots=True)
class ResetWatch:
    """What the previous collection showed of one GPU."""

    lost: bool = False
    recovery_action: int | None = None
    pending: bool = False  # a row remap or page retirement waits for a reset

    def observe(self, sig: GpuHealthSignals | None, lost: str | None) -> str | None:
        """Why this collection shows a reset since the last one, or None; then remember it."""
        if lost is not None or sig is None:
            self.lost = self.lost or lost is not None
            return None
        why = None
        if self.lost:
            why = "the GPU answers again after being lost"
        elif self.recovery_action not in (None, NONE) and sig.recovery_action == NONE:
            why = "the driver's recovery action is back to none"
        pending = _pending(sig)
        if why is None and self.pending and pending is False:
            why = "the pending memory remap was applied"
        self.lost = False
        if sig.recovery_action is not None:
            self.recovery_action = sig.recovery_action
        if pending is not None:
            self.pending = pending
        return why


def _pending(sig: GpuHealthSignals) -> bool | None:
    rows = sig.remapped_rows.pending if sig.remapped_rows is not None else None
    pages = sig.retired_pages_pending
    if rows is None and pages is None:
        return None
    return bool(rows) or bool(pages)
