"""Reading the health signals of each GPU through NVML; call only from the NVML thread.

Every signal is tolerant on its own: NOT_SUPPORTED or a call the driver lacks makes that one
signal absent (the check says "not supported"), another error makes it failed (logged once per
GPU and signal until it reads again). GPU_IS_LOST / RESET_REQUIRED on any call marks the GPU
lost and stops reading it for this pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pynvml

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import GpuLostError
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.errors import lost_error
from gpuid_agent.sources.nvml.fields import read_fields
from gpuid_agent.sources.nvml.links import read_nvlinks, read_pcie
from gpuid_agent.sources.nvml.signals import EccCounts, GpuHealthSignals

_log = log.get("health.nvml")
_CORRECTED, _UNCORRECTED = 0, 1
_VOLATILE, _AGGREGATE = 0, 1


class HealthReader:
    """Synchronous health reads through an NvmlApi."""

    def __init__(self, api: NvmlApi) -> None:
        self.api = api
        self.calls = FieldCalls(_log)

    def read_gpu(self, index: int, uuid: str) -> GpuHealthSignals:
        api = self.api
        absent: dict[str, str] = {}
        failed: dict[str, str] = {}

        def get(name: str, call: Any, *args: Any) -> Any:
            return self.calls.get(index, name, call, *args, absent=absent, failed=failed)

        try:
            handle = api.handle_by_index(index)
            ecc = EccCounts(
                get("ecc", api.ecc_errors, handle, _CORRECTED, _VOLATILE),
                get("ecc", api.ecc_errors, handle, _UNCORRECTED, _VOLATILE),
                get("ecc", api.ecc_errors, handle, _CORRECTED, _AGGREGATE),
                get("ecc", api.ecc_errors, handle, _UNCORRECTED, _AGGREGATE),
            )
            if any(v is not None for v in ecc):
                absent.pop("ecc", None)  # one counter type missing is not "no ECC"
            nvlinks = read_nvlinks(api, self.calls, index, handle, absent=absent, failed=failed)
            fields = read_fields(
                api, self.calls, index, handle, nvlinks, absent=absent, failed=failed
            )
            return GpuHealthSignals(
                index=index,
                uuid=uuid,
                ecc=None if all(v is None for v in ecc) else ecc,
                retired_pages_pending=get("retired_pages", api.retired_pages_pending, handle),
                remapped_rows=get("remapped_rows", api.remapped_rows, handle),
                clocks_event_reasons=get("clocks_event_reasons", api.clocks_event_reasons, handle),
                fabric=get("fabric", api.fabric_info, handle),
                persistence_mode=get("persistence_mode", api.persistence_mode, handle),
                recovery_action=fields.recovery_action,
                pcie=read_pcie(api, self.calls, index, handle, absent=absent, failed=failed),
                nvlinks=fields.nvlinks,
                pcie_aer=fields.pcie_aer,
                absent=MappingProxyType(absent),
                failed=MappingProxyType(failed),
            )
        except GpuLostError as lost:
            return GpuHealthSignals(index=index, uuid=uuid, lost=lost.reason)
        except pynvml.NVMLError as exc:  # the handle itself could not be had
            lost_handle = lost_error(index, exc)
            if lost_handle is not None:
                return GpuHealthSignals(index=index, uuid=uuid, lost=lost_handle.reason)
            self.calls.warn_once(index, "handle", f"no NVML handle for GPU {index}: {exc}")
            return GpuHealthSignals(
                index=index, uuid=uuid, failed=MappingProxyType({"handle": str(exc)})
            )

    def read(self, gpus: Mapping[int, str]) -> dict[int, GpuHealthSignals]:
        """Signals for each readable GPU, given as {index: uuid}."""
        return {index: self.read_gpu(index, uuid) for index, uuid in sorted(gpus.items())}
