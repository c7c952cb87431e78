"""One exception tree: every error the agent raises on purpose derives from GpuidError.

    GpuidError
    ├── ConfigError            invalid settings, or a start they make fail (a port in use);
    │                          names every variable to fix (exit 2)
    ├── NvmlError
    │   ├── NvmlUnavailableError   NVML cannot start (no driver, library, permission)
    │   ├── NvmlStalledError       an NVML call outlived its bound; the thread is abandoned
    │   └── GpuLostError           a GPU answered "lost" or "reset required"
    ├── SourceError
    │   ├── PodResourcesError      the kubelet's pod-resources socket could not be asked
    │   ├── GrpcCallError          a gRPC call to the kubelet ended without status OK
    │   ├── Http2ProtocolError     the kubelet's connection spoke HTTP/2 wrongly
    │   ├── PodResourcesDecodeError   a kubelet answer that is no well-formed message
    │   │                          (also a ValueError)
    │   ├── DeviceIdError          a kubelet device id of no known form (also a ValueError)
    │   ├── KubeConfigError        a Kubernetes configuration that cannot be used
    │   └── KubeApiError           the API server answered with an error status
    ├── WireError              a dict that is no record's wire form (also a ValueError)
    ├── RefusedFileError       a file the agent reads that is no regular file of bounded size
    ├── NewerFormatError       a state file or batch of a newer format than this version reads
    ├── ExportError            an exporter could not deliver a batch
    ├── StoreError
    │   └── CorruptBatchError      a spooled batch that cannot be read back
    └── HistoryError           `gpuid-agent history` could not answer
        ├── NotFoundError          no record of the serial, node or pod asked about (exit 1)
        └── RecordsUnreachableError   the records' store cannot be read; names the setting
                                   to fix (exit 4)

Library errors are wrapped with `raise … from exc`, so the cause stays in the traceback.
"""

from __future__ import annotations


class GpuidError(Exception):
    """Base class of the agent's own errors."""


class ConfigError(GpuidError):
    """Invalid configuration; `problems` maps each variable name to why it is wrong."""

    def __init__(self, problems: dict[str, str], headline: str = "invalid configuration") -> None:
        self.problems = dict(problems)
        # One line, so it reads whole in `kubectl logs` and a crash-looping pod's last state.
        parts = [f"{name}: {' '.join(why.split())}" for name, why in sorted(self.problems.items())]
        super().__init__(f"{headline}: " + "; ".join(parts))


class NvmlError(GpuidError):
    """Something NVML did or did not do."""


class NvmlUnavailableError(NvmlError):
    """NVML could not be initialised (no driver, library missing, permission)."""


class NvmlStalledError(NvmlError):
    """An NVML call did not return within its bound; the call's thread is given up on.
    The message names the calls; `figures` holds what moves while they hang (seconds)."""

    def __init__(self, message: str, figures: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class GpuLostError(NvmlError):
    """A GPU that NVML reports lost (or needing a reset); its identity is kept."""

    def __init__(self, index: int, code: int, reason: str | None = None) -> None:
        super().__init__(reason or f"GPU {index} is lost (NVML error {code})")
        self.index = index
        self.code = code
        self.reason = reason or str(self)


class SourceError(GpuidError):
    """A source (kubelet, Kubernetes API) could not be read."""


class PodResourcesError(SourceError):
    """The kubelet could not be asked; `reason` is short and stable (a status/metric label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class GrpcCallError(SourceError):
    """A gRPC call that did not end with status OK: `status` is the gRPC code (`status_name`
    its name), `details` the server's message or ours, `unsent` true when the connection
    failed before any answer began (a read may then be tried again)."""

    def __init__(self, status: int, status_name: str, details: str, unsent: bool) -> None:
        super().__init__(f"{status_name}: {details}")
        self.status = status
        self.name = status_name
        self.details = details
        self.unsent = unsent


class Http2ProtocolError(SourceError):
    """The server spoke HTTP/2 wrongly: the connection cannot be used any more."""


class PodResourcesDecodeError(SourceError, ValueError):
    """A kubelet answer that is not a well-formed message; the text never quotes it."""


class DeviceIdError(SourceError, ValueError):
    """A device id that fits none of the known forms; `reason` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class KubeConfigError(SourceError):
    """A Kubernetes configuration was found but cannot be used (malformed, unreadable)."""


class KubeApiError(SourceError):
    """The API server answered with an error status (0: no answer at all)."""

    def __init__(
        self, status: int, message: str, *, detail: str = "", retry_after: str | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.detail = detail or message  # the Status object's message alone
        self.retry_after = retry_after  # the Retry-After header, as sent


class WireError(GpuidError, ValueError):
    """A dict that is not the wire form of any record (a spool file or state file damaged, or
    written by something else)."""


class RefusedFileError(GpuidError):
    """What sits at a path the agent reads is not a regular file it will read: a symlink, a
    FIFO, a device, a directory, or a file over the size bound. `reason` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class NewerFormatError(GpuidError):
    """A file written in a newer format than this version reads (`runtime.formats`): kept where
    it is, untouched, for the version that wrote it. Deliberately no ValueError: the readers of
    state files set those aside."""

    def __init__(self, kind: str, found: int, known: int) -> None:
        super().__init__(f"{kind} of format {found}, newer than this version reads (up to {known})")
        self.kind, self.found, self.known = kind, found, known


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


class StoreError(GpuidError):
    """An exporter's batch store (the spool) failed."""


class CorruptBatchError(StoreError):
    """A spooled batch file that cannot be read back as records."""


class HistoryError(GpuidError):
    """`gpuid-agent history` could not answer; the message is one line for the terminal."""


class NotFoundError(HistoryError):
    """No record of what was asked about (a serial, node or pod) in the range asked."""


class RecordsUnreachableError(HistoryError):
    """The database, bucket or directory of records cannot be read; the message names the
    setting to fix."""
