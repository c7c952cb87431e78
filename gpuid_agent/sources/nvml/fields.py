"""The health fields NVML gives as field values, read in one nvmlDeviceGetFieldValues call per
GPU per collection: the driver's recovery action (field 230), the PCIe AER counters and each
NVLink's speed. Call only from the NVML thread.

An entry the driver does not report (not supported, a field id it does not know) is None: that
reading is absent. A driver without the call reports none of them; a failed call fails them
all for this pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from gpuid_agent.facts import NvLink, PcieAer
from gpuid_agent.sources.nvml.api import Handle, NvmlApi
from gpuid_agent.sources.nvml.calls import FieldCalls

RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: nvmlDeviceGpuRecoveryAction_t
# NVML_FI_DEV_PCIE_COUNT_{CORRECTABLE_ERRORS,NON_FATAL_ERROR,FATAL_ERROR}, in PcieAer's order
AER_FIELDS = (173, 179, 180)
NVLINK_SPEED_FIELD = 164  # NVML_FI_DEV_NVLINK_GET_SPEED, MB/s, scope: the link
_NAMES = ("recovery_action", "pcie_aer")  # the readings a failed or missing call leaves out


class FieldReadings(NamedTuple):
    recovery_action: int | None
    pcie_aer: PcieAer | None
    nvlinks: tuple[NvLink, ...] | None  # as given, each with its speed where reported


def read_fields(
    api: NvmlApi,
    calls: FieldCalls,
    index: int,
    handle: Handle,
    nvlinks: tuple[NvLink, ...] | None,
    *,
    absent: dict[str, str],
    failed: dict[str, str],
) -> FieldReadings:
    links: Sequence[NvLink] = nvlinks or ()
    fields = [
        (RECOVERY_ACTION_FIELD, 0),
        *((f, 0) for f in AER_FIELDS),
        *((NVLINK_SPEED_FIELD, lk.link) for lk in links),
    ]
    missing: dict[str, str] = {}
    broken: dict[str, str] = {}
    values = calls.get(
        index, "field_values", api.field_values, handle, fields, absent=missing, failed=broken
    )
    if values is None or len(values) != len(fields):
        if values is not None:  # a driver answering with another number of entries
            broken["field_values"] = f"{len(values)} field values for {len(fields)} asked"
        for name in _NAMES:
            if "field_values" in broken:
                failed[name] = broken["field_values"]
            else:
                absent[name] = missing.get("field_values", "field values not reported")
        return FieldReadings(None, None, nvlinks)
    recovery = _count(values[0])
    if recovery is None:
        absent["recovery_action"] = "NVML field 230 not reported"
    aer: PcieAer | None = PcieAer(*(_count(v) for v in values[1 : 1 + len(AER_FIELDS)]))
    if aer is not None and all(v is None for v in aer):
        absent["pcie_aer"] = "PCIe AER counters not reported"
        aer = None
    if nvlinks is not None:
        speeds = values[1 + len(AER_FIELDS) :]
        nvlinks = tuple(
            lk._replace(speed_mbps=_count(v)) for lk, v in zip(nvlinks, speeds, strict=True)
        )
    return FieldReadings(recovery, aer, nvlinks)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
