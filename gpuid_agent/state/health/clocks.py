"""Clock-event reasons (formerly "throttle reasons"): the bitmask NVML reports, decoded.

Bit values are NVML's `nvmlClocksEventReason*` constants. Only the hardware-side reasons say
something about the GPU's health; idle, application clocks, sync boost, display clocks and the
software power cap are normal operation.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

MASK_64 = (1 << 64) - 1

REASON_BITS: Mapping[str, int] = MappingProxyType(
    {
        "gpu_idle": 0x1,
        "applications_clocks_setting": 0x2,
        "sw_power_cap": 0x4,
        "hw_slowdown": 0x8,
        "sync_boost": 0x10,
        "sw_thermal_slowdown": 0x20,
        "hw_thermal_slowdown": 0x40,
        "hw_power_brake_slowdown": 0x80,
        "display_clock_setting": 0x100,
    }
)
KNOWN_MASK = 0
for _bit in REASON_BITS.values():
    KNOWN_MASK |= _bit

# The reasons a health check watches, most specific first (hw_slowdown is the umbrella bit
# set with the hardware ones, so it is named only when it is alone).
SLOWDOWN_REASONS: Mapping[str, str] = MappingProxyType(
    {
        "hw_thermal_slowdown": "hardware thermal slowdown",
        "hw_power_brake_slowdown": "external power brake slowdown",
        "sw_thermal_slowdown": "software thermal slowdown",
        "hw_slowdown": "hardware slowdown (thermal, power brake or power supply)",
    }
)


def decode_clock_reasons(mask: int) -> frozenset[str]:
    """Names of the known reasons set in `mask`; unknown bits are ignored.

    Raises ValueError for anything that is not an unsigned 64-bit integer, the only thing NVML
    can return here.
    """
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise ValueError(f"clock-event reasons must be an integer, got {type(mask).__name__}")
    if mask < 0 or mask > MASK_64:
        raise ValueError(f"clock-event reasons {mask:#x} is not an unsigned 64-bit value")
    return frozenset(name for name, bit in REASON_BITS.items() if mask & bit)


def unknown_bits(mask: int) -> int:
    """Bits set in a valid mask that no known reason claims (a newer driver's additions)."""
    return mask & MASK_64 & ~KNOWN_MASK
