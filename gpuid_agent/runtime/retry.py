"""The one retry policy: exponential backoff with full jitter, and the one Retry-After parser.

Full jitter (a delay uniform in [0, min(cap, base·2ⁿ)]) spreads a fleet that failed together
better than equal jitter, at the cost of sometimes retrying at once; every retrying component
of the agent (exporters, NVML start, the kubelet and API clients, node writes) uses it.
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

RETRY_AFTER_CAP = 300.0  # the longest pause any server's Retry-After may impose on us


def backoff_ceiling(attempt: int, base: float, cap: float) -> float:
    """The largest delay retry number `attempt` (0-based) may draw: min(cap, base·2^attempt)."""
    return min(cap, base * 2.0 ** min(max(attempt, 0), 62))


def backoff_delay(
    attempt: int,
    base: float,
    cap: float,
    rand: random.Random | None = None,
    *,
    floor: float | None = None,
) -> float:
    """The one backoff formula: the pause before retry number `attempt` (0-based), uniform in
    [0, backoff_ceiling()], raised to `floor` (a server's Retry-After, itself capped at
    RETRY_AFTER_CAP) when one is given."""
    delay = (rand or random).uniform(0.0, backoff_ceiling(attempt, base, cap))
    if floor is not None:
        delay = max(delay, min(floor, RETRY_AFTER_CAP))
    return delay


class Backoff:
    """`backoff_delay` for callers that do not count attempts themselves: `next()` after
    each failure, `reset()` after a success."""

    def __init__(self, base: float, cap: float, rand: random.Random | None = None) -> None:
        if base <= 0 or cap <= 0:
            raise ValueError("backoff base and cap must be positive")
        self.base = base
        self.cap = cap
        self.failures = 0
        self._rand = rand or random.Random()

    def ceiling(self) -> float:
        """The largest delay the next failure may draw."""
        return backoff_ceiling(self.failures, self.base, self.cap)

    def next(self, floor: float | None = None) -> float:
        """The pause after one more failure (`floor`: see `backoff_delay`)."""
        delay = backoff_delay(self.failures, self.base, self.cap, self._rand, floor=floor)
        self.failures += 1
        return delay

    def reset(self) -> None:
        """After a success: the next failure starts again from `base`."""
        self.failures = 0


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds (digits only, RFC 9110) or an
    HTTP date, clamped to [0, RETRY_AFTER_CAP]. None when absent or unreadable: negative or
    fractional numbers, `inf`, `nan` and other garbage are rejected, not guessed at."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text.isascii() and text.isdigit():
        # more than six significant digits is past the cap anyway; int() of thousands of
        # digits would raise
        digits = text.lstrip("0") or "0"
        if len(digits) > 6:
            return RETRY_AFTER_CAP
        return min(float(int(digits)), RETRY_AFTER_CAP)
    if text[0] in "+-." or text[0].isdigit():
        return None  # a number, but not delta-seconds
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - (now or datetime.now(UTC))).total_seconds()
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP)
