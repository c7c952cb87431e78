"""XID classification: which XIDs matter, how much, and what to do about them.

Source: NVIDIA's XID catalogue for Ampere and newer GPUs, "Analyzing Xid Errors with the Xid
Catalog" (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column
"Resolution Bucket (Immediate Action)", mapped onto this agent's four actions:

    IGNORE                              → none
    RESTART_APP                         → check_workload
    RESET_GPU, RESTART_BM, WORKFLOW_*   → reboot   (a reboot is also a GPU reset)
    CONTACT_SUPPORT, CHECK_MECHANICALS  → hardware_inspection

A *latched* XID keeps its GPU in that state until the agent restarts (a reboot restarts it);
the others hold for `XID_HOLD` after the last occurrence and then clear. docs/health.md has the
table in prose; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from gpuid_agent.state.health.model import Action

XidState = Literal["healthy", "degraded", "unhealthy"]


@dataclass(frozen=True, slots=True)
class XidClass:
    code: int
    name: str
    state: XidState  # "healthy": counted and shown, never changes the GPU's state
    action: Action
    latched: bool = False


def _entry(
    code: int, name: str, state: XidState, action: Action, latched: bool = False
) -> tuple[int, XidClass]:
    return code, XidClass(code, name, state, action, latched)


XID_TABLE: Mapping[int, XidClass] = MappingProxyType(
    dict(
        [
            _entry(8, "GPU stopped processing (idle timeout)", "degraded", "check_workload"),
            _entry(13, "graphics engine exception", "degraded", "check_workload"),
            _entry(31, "GPU memory page fault", "degraded", "check_workload"),
            _entry(32, "invalid or corrupted push buffer stream", "degraded", "check_workload"),
            _entry(43, "GPU stopped processing (channel reset)", "degraded", "check_workload"),
            _entry(45, "preemptive cleanup after an earlier error", "healthy", "none"),
            _entry(46, "GPU stopped processing", "unhealthy", "reboot", latched=True),
            _entry(48, "double-bit ECC error (DBE)", "unhealthy", "reboot", latched=True),
            _entry(61, "internal micro-controller breakpoint", "unhealthy", "reboot", latched=True),
            _entry(62, "internal micro-controller halt", "unhealthy", "reboot", latched=True),
            _entry(
                63,
                "row remapping / page retirement recorded: reset to apply",
                "unhealthy",
                "reboot",
                latched=True,
            ),
            _entry(
                64,
                "row remapping / page retirement recording failed",
                "unhealthy",
                "hardware_inspection",
                latched=True,
            ),
            _entry(68, "video processor exception", "degraded", "check_workload"),
            _entry(69, "graphics engine class error", "degraded", "check_workload"),
            _entry(74, "NVLink error", "unhealthy", "reboot", latched=True),
            _entry(79, "GPU has fallen off the bus", "unhealthy", "reboot", latched=True),
            _entry(92, "high single-bit ECC error rate", "degraded", "hardware_inspection"),
            _entry(94, "contained ECC error", "degraded", "check_workload"),
            _entry(95, "uncontained ECC error", "unhealthy", "reboot", latched=True),
            _entry(109, "context switch timeout", "degraded", "check_workload"),
            _entry(119, "GSP RPC timeout", "unhealthy", "reboot", latched=True),
            _entry(120, "GSP error", "unhealthy", "reboot", latched=True),
            _entry(121, "C2C link corrected error", "degraded", "none"),
            _entry(140, "unrecovered ECC error", "unhealthy", "reboot", latched=True),
            _entry(154, "GPU recovery action changed", "unhealthy", "reboot", latched=True),
        ]
    )
)

CRITICAL_XIDS = frozenset(code for code, c in XID_TABLE.items() if c.state == "unhealthy")


def classify_xid(code: int) -> XidClass:
    """The class of an XID code; any code outside the table (or out of range) is degraded.

    An XID the table does not name is still an error the driver thought worth reporting, so it
    is shown (degraded, check the workload) rather than ignored.
    """
    known = XID_TABLE.get(code) if isinstance(code, int) and not isinstance(code, bool) else None
    if known is not None:
        return known
    return XidClass(
        code=code if isinstance(code, int) else -1,
        name="XID not in the catalogue table",
        state="degraded",
        action="check_workload",
    )
