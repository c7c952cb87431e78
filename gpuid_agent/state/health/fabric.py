"""NVLink fabric state and health mask (nvmlDeviceGetGpuFabricInfoV), decoded and judged.

Field positions and values are NVML's `NVML_GPU_FABRIC_HEALTH_MASK_*` constants: 2-bit fields
(0 = not supported, 1 = true, 2 = false) except the 4-bit "incorrect configuration" field.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuid_agent.sources.nvml.signals import FabricInfo
from gpuid_agent.state.health.verdicts import Verdict

STATE_NOT_SUPPORTED, STATE_NOT_STARTED, STATE_IN_PROGRESS, STATE_COMPLETED = 0, 1, 2, 3
SUMMARY_HEALTHY, SUMMARY_UNHEALTHY, SUMMARY_LIMITED = 1, 2, 3
_TRUE, _FALSE = 1, 2
_CONFIG_NONE = 1
_GFM_DISCONNECTED = 2
_CONFIG_PROBLEMS = {
    2: "incorrect system GUID",
    3: "incorrect chassis serial number",
    4: "no partition",
    5: "insufficient NVLinks",
    6: "incompatible GPU firmware",
    7: "invalid location",
    8: "GPU state invalid",
}
MASK_32 = (1 << 32) - 1


@dataclass(frozen=True, slots=True)
class FabricHealth:
    degraded_bandwidth: bool
    route_recovery: bool
    route_unhealthy: bool
    access_timeout_recovery: bool
    incorrect_configuration: str | None
    fabric_manager_disconnected: bool


def _field(mask: int, shift: int, width: int) -> int:
    return (mask >> shift) & width


def decode_health_mask(mask: int) -> FabricHealth:
    """Decode a fabric health mask; ValueError for anything but an unsigned 32-bit value."""
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask <= MASK_32:
        raise ValueError(f"fabric health mask {mask!r} is not an unsigned 32-bit value")
    config = _field(mask, 8, 0xF)
    problem: str | None = None
    if config not in (0, _CONFIG_NONE):
        problem = _CONFIG_PROBLEMS.get(config, f"configuration problem {config}")
    return FabricHealth(
        degraded_bandwidth=_field(mask, 0, 0x3) == _TRUE,
        route_recovery=_field(mask, 2, 0x3) == _TRUE,
        route_unhealthy=_field(mask, 4, 0x3) == _TRUE,
        access_timeout_recovery=_field(mask, 6, 0x3) == _TRUE,
        incorrect_configuration=problem,
        fabric_manager_disconnected=_field(mask, 14, 0x3) == _GFM_DISCONNECTED,
    )


def fabric_verdict(info: FabricInfo) -> Verdict:
    if info.state == STATE_NOT_SUPPORTED:
        return Verdict("not_supported", "this GPU is not part of an NVLink fabric")
    if info.state in (STATE_NOT_STARTED, STATE_IN_PROGRESS):
        what = "not started" if info.state == STATE_NOT_STARTED else "in progress"
        return Verdict("degraded", f"fabric registration {what}", "none")
    if info.state != STATE_COMPLETED:
        return Verdict("unknown", f"unrecognised fabric state {info.state}")
    if info.status != 0:
        return Verdict(
            "unhealthy", f"fabric registration failed (NVML status {info.status})", "reboot"
        )
    try:
        health = decode_health_mask(info.health_mask)
    except ValueError as exc:
        return Verdict("unknown", str(exc))
    if health.incorrect_configuration:
        return Verdict(
            "unhealthy",
            f"fabric misconfigured: {health.incorrect_configuration}",
            "hardware_inspection",
        )
    if health.route_unhealthy or info.health_summary == SUMMARY_UNHEALTHY:
        return Verdict("unhealthy", "fabric route unhealthy", "hardware_inspection")
    if health.degraded_bandwidth or info.health_summary == SUMMARY_LIMITED:
        return Verdict("degraded", "NVLink bandwidth degraded", "hardware_inspection")
    if health.route_recovery or health.access_timeout_recovery:
        return Verdict("degraded", "fabric recovery in progress", "none")
    if health.fabric_manager_disconnected:
        return Verdict("degraded", "disconnected from the fabric manager", "none")
    return Verdict("healthy")
