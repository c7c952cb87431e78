"""The one tolerant way to read an NVML field.

A field NVML does not have here (NOT_SUPPORTED, a call the driver lacks, no permission, no
data: `errors.ABSENT`) is absent, not an error. A lost GPU (GPU_IS_LOST, RESET_REQUIRED)
raises `GpuLostError` so the caller stops reading that GPU for this pass. Any other NVML
error, or a value pynvml could not decode, fails that one field: counted, logged once per GPU
and field until it reads again, and survived.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

from gpuid_agent.sources.nvml.errors import absent_reason, lost_error

T = TypeVar("T")

# what pynvml raises for a value it cannot convert (bad UTF-8, a number out of range)
MALFORMED = (ValueError, UnicodeDecodeError, OverflowError)


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
            reason = absent_reason(exc)
            if reason is not None:
                if absent is not None:
                    absent[name] = reason
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
