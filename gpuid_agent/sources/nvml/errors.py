"""What an NVML error means to the agent: the one place NVML return codes are told apart.

pynvml raises `NVMLError` (a subclass per code) with the return code in `.value`. Every code
the agent acts on is sorted here into an `NvmlFault`; callers decide by fault, never by code.
A code not listed is `OTHER`: a failure of that one call.
"""

from __future__ import annotations

import enum

import pynvml

from gpuid_agent.runtime.errors import GpuLostError


class NvmlFault(enum.Enum):
    LOST = "lost"  # the GPU fell off the bus or needs a reset: stop reading it this pass
    NO_CALL = "no call"  # the driver predates this call
    NOT_SUPPORTED = "not supported"  # this GPU or driver does not offer it
    NO_PERMISSION = "no permission"  # not offered to this reader
    NOT_FOUND = "not found"  # nothing of the kind now (no samples since, no instance)
    NO_DATA = "no data"
    VERSION_MISMATCH = "version mismatch"  # a newer struct version than the driver knows
    INVALID_ARGUMENT = "invalid argument"  # also: an index past the last (NVLinks)
    TIMEOUT = "timeout"  # a wait that saw nothing
    OTHER = "other"


_FAULTS = {
    pynvml.NVML_ERROR_GPU_IS_LOST: NvmlFault.LOST,
    pynvml.NVML_ERROR_RESET_REQUIRED: NvmlFault.LOST,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: NvmlFault.NO_CALL,
    pynvml.NVML_ERROR_NOT_SUPPORTED: NvmlFault.NOT_SUPPORTED,
    pynvml.NVML_ERROR_NO_PERMISSION: NvmlFault.NO_PERMISSION,
    pynvml.NVML_ERROR_NOT_FOUND: NvmlFault.NOT_FOUND,
    pynvml.NVML_ERROR_NO_DATA: NvmlFault.NO_DATA,
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlFault.VERSION_MISMATCH,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: NvmlFault.INVALID_ARGUMENT,
    pynvml.NVML_ERROR_TIMEOUT: NvmlFault.TIMEOUT,
}
_LOST_REASONS = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost (fallen off the bus or unreachable)",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires a reset",
}

# A value that is not there, which is no error: the field reads as absent.
ABSENT = frozenset(
    {
        NvmlFault.NO_CALL,
        NvmlFault.NOT_SUPPORTED,
        NvmlFault.NO_PERMISSION,
        NvmlFault.NOT_FOUND,
        NvmlFault.NO_DATA,
    }
)
# A feature this GPU or driver does not offer the agent at all (XID events): not retried.
UNOFFERED = frozenset({NvmlFault.NO_CALL, NvmlFault.NOT_SUPPORTED, NvmlFault.NO_PERMISSION})
# The newest variant of a call is not usable here; the older one may be.
OLDER_CALL = frozenset({NvmlFault.NO_CALL, NvmlFault.NOT_SUPPORTED, NvmlFault.VERSION_MISMATCH})


def error_code(exc: pynvml.NVMLError) -> int | None:
    value = getattr(exc, "value", None)
    return int(value) if value is not None else None


def fault(exc: pynvml.NVMLError) -> NvmlFault:
    """What this NVML error means."""
    code = error_code(exc)
    return NvmlFault.OTHER if code is None else _FAULTS.get(code, NvmlFault.OTHER)


def lost_error(index: int, exc: pynvml.NVMLError) -> GpuLostError | None:
    """The GpuLostError an NVML error means for GPU `index`, or None."""
    code = error_code(exc)
    if code is None or code not in _LOST_REASONS:
        return None
    return GpuLostError(index, code, _LOST_REASONS[code])


def absent_reason(exc: pynvml.NVMLError) -> str | None:
    """Why a field is absent, as /status says it; None when the error is no absence."""
    found = fault(exc)
    if found not in ABSENT:
        return None
    if found is NvmlFault.NO_CALL:
        return "the driver lacks this NVML call"
    return f"not supported ({exc})"
