"""The driver's own recovery action for a GPU: NVML field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
(230, drivers R565 and newer), read every collection.

The driver sets it when a fault needs more than restarting the application, and sets it back
to NONE once the recovery it asked for happened. It is the `recovery` check, and it is what
XID 154 ("GPU recovery action changed") announces: the XID itself is only counted while the
driver reports the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gpuid_agent.state.health.verdicts import HEALTHY, Action, CheckState, Verdict

NONE = 0
# nvmlDeviceGpuRecoveryAction_t, named as nvml.h names it -> (state, action, what is asked).
# 0-4 since R565; 5 (RECOVER_IMEX_DOMAIN) and 6-7 (BUS_RESET, SYSTEM_REBOOT) were added by
# later headers (NVML 615's change log; nvidia-ml-py 13.615 defines all eight). A value this
# table lacks is reported by its number.
_ACTIONS: Mapping[int, tuple[str, CheckState, Action, str]] = MappingProxyType(
    {
        1: ("GPU_RESET", "unhealthy", "reset", "a GPU reset"),
        2: ("NODE_REBOOT", "unhealthy", "reboot", "a node reboot"),
        3: ("DRAIN_P2P", "degraded", "drain", "draining peer-to-peer traffic"),
        4: ("DRAIN_AND_RESET", "unhealthy", "reset", "draining, then a GPU reset"),
        5: ("RECOVER_IMEX_DOMAIN", "degraded", "none", "recovering the IMEX domain"),
        6: ("BUS_RESET", "unhealthy", "reset", "a reset of the GPU's PCIe bus"),
        7: ("SYSTEM_REBOOT", "unhealthy", "reboot", "a system reboot"),
    }
)
HEADER_PREFIX = "NVML_GPU_RECOVERY_ACTION_"
NOT_REPORTED = (
    "the driver does not report a recovery action (NVML field 230, R565+): "
    "XID 154 is judged by the catalogue"
)


def recovery_verdict(action: int) -> Verdict:
    if action == NONE:
        return HEALTHY
    known = _ACTIONS.get(action)
    if known is None:
        return Verdict(
            "degraded",
            f"the driver reports recovery action {action}, which no nvml.h known here names",
        )
    name, state, suggested, what = known
    reason = f"the driver asks for {what} ({HEADER_PREFIX}{name}, {action})"
    return Verdict(state, reason, suggested)


def action_name(action: int) -> str:
    """The header's name of a recovery action value, or the value itself."""
    known = _ACTIONS.get(action)
    return f"{HEADER_PREFIX}{known[0]}" if known else str(action)
