"""One exception tree: every error the agent raises on purpose derives from GpuidError."""

from __future__ import annotations


class GpuidError(Exception):
    """Base class of the agent's own errors."""


class ConfigError(GpuidError):
    """Invalid configuration; `problems` maps each variable name to why it is wrong."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = dict(problems)
        lines = [f"  {name}: {why}" for name, why in sorted(self.problems.items())]
        super().__init__("invalid configuration:\n" + "\n".join(lines))


class NvmlUnavailableError(GpuidError):
    """NVML could not be initialised (no driver, library missing, permission)."""


class ExportError(GpuidError):
    """An exporter failed to deliver a batch.

    `retryable` says whether the same batch may succeed later (a sink outage) or never will
    (the sink rejected its content); `retry_after` is the pause the sink asked for, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        error_type: str,
        retryable: bool = True,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.retryable = retryable
        self.retry_after = retry_after
