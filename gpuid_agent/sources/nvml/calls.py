"""The one tolerant way to read an NVML field.

A field NVML does not have here (NOT_SUPPORTED, a call the driver lacks, no permission, no
data) is absent, not an error. A lost GPU (GPU_IS_LOST, RESET_REQUIRED) raises `GpuLostError`
so the caller stops reading that GPU for this pass. Any other NVML error, or a value pynvml
could not decode, fails that one field: counted, logged once per GPU and field until it reads
again, and survived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuid_agent.runtime.errors import GpuLostError

T = TypeVar("T")

# Codes meaning "this field is not available here", not "something is wrong".
ABSENT_CODES = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_NO_DATA,
    }
)
LOST_REASONS = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "GPU is lost (fallen off the bus or unreachable)",
    pynvml.NVML_ERROR_RESET_REQUIRED: "GPU requires a reset",
}
LOST_CODES = frozenset(LOST_REASONS)
# what pynvml raises for a value it cannot convert (bad UTF-8, a number out of range)
MALFORMED = (ValueError, UnicodeDecodeError, OverflowError)


def error_code(exc: pynvml.NVMLError) -> int | None:
    value = getattr(exc, "value", None)
    return int(value) if value is not None else None


def lost_error(index: int, exc: pynvml.NVMLError) -> GpuLostError | None:
    """The GpuLostError an NVML error means for GPU `index`, or None."""
    code = error_code(exc)
    if code is None or code not in LOST_REASONS:
        return None
    return GpuLostError(index, code, LOST_REASONS[code])


class FieldCalls:
    """Tolerant field reads with log-once bookkeeping; one per reader, used on one thread.

    `errors` counts failed fields since the last `reset()`. When `absent` / `failed` maps are
    passed to `get`, the reason of an absent or failed field is put there under its name.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._warned: set[tuple[int, str]] = set()
        self.errors = 0

    def reset(self) -> None:
        self.errors = 0

    def get(
        self,
        index: int,
        name: str,
        call: Callable[..., T],
        *args: Any,
        absent: dict[str, str] | None = None,
        failed: dict[str, str] | None = None,
    ) -> T | None:
        try:
            value = call(*args)
        except pynvml.NVMLError as exc:
            lost = lost_error(index, exc)
            if lost is not None:
                raise lost from exc
            code = error_code(exc)
            if code in ABSENT_CODES:
                if absent is not None:
                    absent[name] = (
                        "the driver lacks this NVML call"
                        if code == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
                        else f"not supported ({exc})"
                    )
                return None
            self._fail(index, name, f"NVML error reading {name}: {exc}")
            if failed is not None:
                failed[name] = f"NVML error: {exc}"
            return None
        except MALFORMED as exc:
            self._fail(index, name, f"malformed {name} from NVML: {exc}")
            if failed is not None:
                failed[name] = f"malformed value: {exc}"
            return None
        self._warned.discard((index, name))
        return value

    def _fail(self, index: int, name: str, message: str) -> None:
        self.errors += 1
        self.warn_once(index, name, message)

    def warn_once(self, index: int, name: str, message: str) -> None:
        if (index, name) not in self._warned:
            self._warned.add((index, name))
            self._log.warning(message, extra={"gpu": index, "field": name})

    def recovered(self, index: int, name: str) -> None:
        self._warned.discard((index, name))
