"""What to do after a failed API call: retry now, back off, or wait for the next resync.

- 409 Conflict: the Node changed between our read and our patch → re-read and retry now.
- 429 Too Many Requests: back off, pausing at least what Retry-After says.
- 5xx, timeouts, connection errors, malformed answers: back off (runtime.retry's policy).
- 401/403/404/422 and other 4xx: retrying soon cannot help (RBAC, a missing Node, a rejected
  value) → report it once and try again on the resync cadence, never in a hot loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import aiohttp

from gpuid_agent.runtime.errors import KubeApiError
from gpuid_agent.runtime.retry import parse_retry_after

Retry = Literal["now", "backoff", "resync"]

_BY_STATUS: dict[int, tuple[str, Retry]] = {
    401: ("unauthorized", "resync"),
    403: ("forbidden", "resync"),
    404: ("not_found", "resync"),
    409: ("conflict", "now"),
    422: ("invalid", "resync"),
    429: ("throttled", "backoff"),
}

# every reason classify() and the reconciler give; the error counter starts at 0 for each
REASONS = (
    *sorted({reason for reason, _ in _BY_STATUS.values()}),
    "server_error",
    "connection",
    "client_error",
    "timeout",
    "malformed",
)


@dataclass(frozen=True, slots=True)
class Failure:
    reason: str  # metric label value, one of a fixed set
    retry: Retry
    detail: str  # stable text for logs and /status (no request-specific numbers)
    retry_after: float | None = None


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, KubeApiError):
        status = exc.status
        message = exc.detail.strip()[:300]
        if status in _BY_STATUS:
            reason, retry = _BY_STATUS[status]
            retry_after = None
            if status == 429:
                retry_after = parse_retry_after(exc.retry_after)
            return Failure(reason, retry, f"{status} {message}".strip(), retry_after)
        if status >= 500:
            return Failure("server_error", "backoff", f"API server error {status}")
        if status == 0:
            return Failure("connection", "backoff", "no answer from the API server")
        return Failure("client_error", "resync", f"{status} {message}".strip())
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return Failure("timeout", "backoff", "API request timed out")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return Failure("connection", "backoff", f"API server unreachable: {type(exc).__name__}")
    return Failure("malformed", "backoff", f"unexpected answer: {type(exc).__name__}")
