"""What to do after a failed API call: retry now, back off, or wait for the next resync.

- 409 Conflict: the Node changed between our read and our patch → re-read and retry now.
- 429 Too Many Requests: wait what Retry-After says (else back off).
- 5xx, timeouts, connection errors, malformed answers: exponential backoff with jitter,
  capped.
- 401/403/404/422 and other 4xx: retrying soon cannot help (RBAC, a missing Node, a rejected
  value) → report it once and try again on the resync cadence, never in a hot loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

Retry = Literal["now", "backoff", "resync"]
MAX_RETRY_AFTER = 3600.0

_BY_STATUS: dict[int, tuple[str, Retry]] = {
    401: ("unauthorized", "resync"),
    403: ("forbidden", "resync"),
    404: ("not_found", "resync"),
    409: ("conflict", "now"),
    422: ("invalid", "resync"),
    429: ("throttled", "backoff"),
}


@dataclass(frozen=True, slots=True)
class Failure:
    reason: str  # metric label value, one of a fixed set
    retry: Retry
    detail: str  # stable text for logs and /status (no request-specific numbers)
    retry_after: float | None = None


def _status_message(exc: ApiException) -> str:
    try:
        body: Any = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    text = str(message or exc.reason or "").strip()
    return text[:300]


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped."""
    if not value:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if math.isnan(seconds):
        return None
    return min(MAX_RETRY_AFTER, max(0.0, seconds))


def classify(exc: BaseException) -> Failure:
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        message = _status_message(exc)
        if status in _BY_STATUS:
            reason, retry = _BY_STATUS[status]
            retry_after = None
            if status == 429:
                headers: Mapping[str, str] = exc.headers or {}
                retry_after = parse_retry_after(headers.get("Retry-After"))
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


class Backoff:
    """Exponential backoff with "equal jitter": the n-th delay is uniform in
    [d/2, d] with d = min(cap, base·2ⁿ), so a fleet restarted together spreads out."""

    def __init__(self, base: float, cap: float, rand: random.Random | None = None) -> None:
        self.base = base
        self.cap = cap
        self.failures = 0
        self._rand = rand or random.Random()

    def next(self) -> float:
        ceiling = min(self.cap, self.base * 2.0 ** min(self.failures, 62))
        self.failures += 1
        return self._rand.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.failures = 0
