"""Reading the health signals of each GPU through NVML; call only from the NVML thread.

Every signal is tolerant on its own: NOT_SUPPORTED or a call the driver lacks makes that one
signal absent (the check says "not supported"), another error makes it failed (logged once per
GPU and signal until it reads again). GPU_IS_LOST / RESET_REQUIRED on any call marks the GPU
lost and stops reading it for this pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import pynvml

from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import GpuLostError
from gpuid_agent.sources.nvml.api import NvmlApi
from gpuid_agent.sources.nvml.signals import EccCounts, GpuHealthSignals

T = TypeVar("T")
_log = log.get("health.nvml")

_LOST = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost (fallen off the bus or unreachable)",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires a reset",
}
_UNSUPPORTED = (
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_NOT_FOUND,
    pynvml.NVML_ERROR_NO_PERMISSION,
    pynvml.NVML_ERROR_NO_DATA,
)
_CORRECTED, _UNCORRECTED = 0, 1
_VOLATILE, _AGGREGATE = 0, 1


class _Pass:
    """The per-GPU bookkeeping of one read."""

    def __init__(self, reader: HealthReader, index: int) -> None:
        self.reader = reader
        self.index = index
        self.absent: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def get(self, name: str, call: Callable[..., T], *args: Any) -> T | None:
        try:
            value = call(*args)
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in _LOST:
                raise GpuLostError(self.index, int(code or 0), _LOST[code]) from exc
            if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                self.absent[name] = "the driver lacks this NVML call"
            elif code in _UNSUPPORTED:
                self.absent[name] = f"not supported ({exc})"
            else:
                self.failed[name] = f"NVML error: {exc}"
                self.reader.warn_once(self.index, name, f"NVML error reading {name}: {exc}")
            return None
        except (ValueError, TypeError, OverflowError) as exc:
            self.failed[name] = f"malformed value: {exc}"
            self.reader.warn_once(self.index, name, f"malformed {name} from NVML: {exc}")
            return None
        self.reader.recovered(self.index, name)
        return value


class HealthReader:
    """Synchronous health reads through an NvmlApi."""

    def __init__(self, api: NvmlApi) -> None:
        self.api = api
        self._warned: set[tuple[int, str]] = set()

    def warn_once(self, index: int, name: str, message: str) -> None:
        if (index, name) not in self._warned:
            self._warned.add((index, name))
            _log.warning(message, extra={"gpu": index, "field": name})

    def recovered(self, index: int, name: str) -> None:
        self._warned.discard((index, name))

    def read_gpu(self, index: int, uuid: str) -> GpuHealthSignals:
        api = self.api
        step = _Pass(self, index)
        try:
            handle = api.handle_by_index(index)
            ecc = EccCounts(
                step.get("ecc", api.ecc_errors, handle, _CORRECTED, _VOLATILE),
                step.get("ecc", api.ecc_errors, handle, _UNCORRECTED, _VOLATILE),
                step.get("ecc", api.ecc_errors, handle, _CORRECTED, _AGGREGATE),
                step.get("ecc", api.ecc_errors, handle, _UNCORRECTED, _AGGREGATE),
            )
            if any(v is not None for v in ecc):
                step.absent.pop("ecc", None)  # one counter type missing is not "no ECC"
            signals = GpuHealthSignals(
                index=index,
                uuid=uuid,
                ecc=None if all(v is None for v in ecc) else ecc,
                retired_pages_pending=step.get("retired_pages", api.retired_pages_pending, handle),
                remapped_rows=step.get("remapped_rows", api.remapped_rows, handle),
                clocks_event_reasons=step.get(
                    "clocks_event_reasons", api.clocks_event_reasons, handle
                ),
                fabric=step.get("fabric", api.fabric_info, handle),
                persistence_mode=step.get("persistence_mode", api.persistence_mode, handle),
                absent=MappingProxyType(step.absent),
                failed=MappingProxyType(step.failed),
            )
        except GpuLostError as lost:
            return GpuHealthSignals(index=index, uuid=uuid, lost=lost.reason)
        except pynvml.NVMLError as exc:  # the handle itself could not be had
            code = getattr(exc, "value", None)
            reason = _LOST.get(code) if code is not None else None
            if reason is not None:
                return GpuHealthSignals(index=index, uuid=uuid, lost=reason)
            self.warn_once(index, "handle", f"no NVML handle for GPU {index}: {exc}")
            return GpuHealthSignals(
                index=index, uuid=uuid, failed=MappingProxyType({"handle": str(exc)})
            )
        return signals

    def read(self, gpus: Mapping[int, str]) -> dict[int, GpuHealthSignals]:
        """Signals for each readable GPU, given as {index: uuid}."""
        return {index: self.read_gpu(index, uuid) for index, uuid in sorted(gpus.items())}
