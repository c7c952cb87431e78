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
# nvmlDeviceGpuRecoveryAction_t -> (state, action, what the driver asks for)
_ACTIONS: Mapping[int, tuple[CheckState, Action, str]] = MappingProxyType(
    {
        1: ("unhealthy", "reset", "a GPU reset"),
        2: ("unhealthy", "reboot", "a node reboot"),
        3: ("degraded", "drain", "draining peer-to-peer traffic"),
        4: ("unhealthy", "reset", "draining peer-to-peer traffic, then a GPU reset"),
        5: ("degraded", "none", "recovering the IMEX domain"),
        6: ("unhealthy", "reset", "a reset of the GPU's PCIe bus"),
        7: ("unhealthy", "reboot", "a system reboot"),
    }
)
NOT_REPORTED = (
    "the driver does not report a recovery action (NVML field 230, R565+): "
    "XID 154 is judged by the catalogue"
)


def recovery_verdict(action: int) -> Verdict:
    if action == NONE:
        return HEALTHY
    known = _ACTIONS.get(action)
    if known is None:
        return Verdict("degraded", f"the driver reports recovery action {action}, unknown here")
    state, suggested, what = known
    return Verdict(state, f"the driver asks for {what} (NVML recovery action {action})", suggested)
