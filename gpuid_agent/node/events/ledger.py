"""Which Event occurrences are written, and when: the write budget and the series.

Pure and driven by a clock (monotonic seconds) so every rule is testable without waiting.

- **Series.** An occurrence with the same key (reason and note: same Node, check, GPU, pods
  and words) as an Event created within `series_window` of its last occurrence is a repeat:
  it raises that Event's series count and last observed time instead of making a new object.
  Repeats are coalesced: an Event's series is patched at most once every `patch_every`
  seconds, with the count as it then stands. A repeat is never dropped; its patch only waits.
- **Budget.** Every API write (a create or a series patch) takes a token from one bucket of
  `burst` tokens refilled by one every `refill_every` seconds. A new Event that finds the
  bucket empty is dropped (the caller counts it); a due series patch waits for a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from gpuid_agent.node.events.notes import EventText

BURST = 25
REFILL_EVERY = 10.0  # seconds per token
SERIES_WINDOW = 600.0  # a repeat later than this after the last occurrence is a new Event
PATCH_EVERY = 10.0  # seconds between two writes of one Event's series


class TokenBucket:
    def __init__(self, burst: int, refill_every: float, now: float) -> None:
        if burst < 1 or refill_every <= 0:
            raise ValueError("a budget needs a burst of at least 1 and a positive refill")
        self.burst = burst
        self.refill_every = refill_every
        self._tokens = float(burst)
        self._at = now

    def tokens(self, now: float) -> float:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) / self.refill_every)
            self._at = now
        return self._tokens

    def take(self, now: float) -> bool:
        if self.tokens(now) < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def wait(self, now: float) -> float:
        """Seconds until a token is there (0 when one is)."""
        return max(0.0, (1.0 - self.tokens(now)) * self.refill_every)


@dataclass(slots=True)
class Series:
    """An Event on the API server and the occurrences it stands for."""

    name: str
    text: EventText  # the first occurrence: what the Event says, and its eventTime
    seen_at: float  # monotonic time of the last occurrence
    written_at: float  # monotonic time of the last write (create or patch)
    last_observed: datetime  # wall-clock time of the last occurrence
    count: int = 1  # occurrences so far, the first included
    written: int = 1  # the count the API server has

    @property
    def owed(self) -> bool:
        return self.count > self.written


class Decision(Enum):
    CREATE = "create"  # a new Event: the caller writes it, then calls `created`
    REPEAT = "repeat"  # merged into a live Event's series
    DROP = "drop"  # a new Event over the budget


class EventLedger:
    def __init__(
        self,
        *,
        burst: int = BURST,
        refill_every: float = REFILL_EVERY,
        series_window: float = SERIES_WINDOW,
        patch_every: float = PATCH_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.budget = TokenBucket(burst, refill_every, clock())
        self.series_window = series_window
        self.patch_every = patch_every
        self._series: dict[str, Series] = {}  # by Event name
        self._latest: dict[tuple[str, str], Series] = {}  # the newest Event of each key

    def decide(self, text: EventText) -> Decision:
        """What to do with one occurrence; a CREATE has taken its token."""
        now = self.clock()
        self._forget(now)
        live = self._latest.get(text.key)
        if live is not None and now - live.seen_at <= self.series_window:
            live.count += 1
            live.seen_at = now
            live.last_observed = max(live.last_observed, text.observed)
            return Decision.REPEAT
        return Decision.CREATE if self.budget.take(now) else Decision.DROP

    def created(self, text: EventText, name: str) -> Series:
        """The Event for `text` exists on the API server as `name`: repeats join it."""
        now = self.clock()
        series = Series(name, text, now, now, text.observed)
        self._series[name] = self._latest[text.key] = series
        return series

    def due(self) -> list[Series]:
        """Series whose repeats are owed and may be written now, oldest write first."""
        now = self.clock()
        ready = [
            s for s in self._series.values() if s.owed and now - s.written_at >= self.patch_every
        ]
        return sorted(ready, key=lambda s: s.written_at)

    def take(self) -> bool:
        """A token for a series patch, if the budget has one now."""
        return self.budget.take(self.clock())

    def patched(self, series: Series, count: int) -> None:
        series.written = count
        series.written_at = self.clock()

    def forget(self, series: Series) -> None:
        """The Event is gone from the API server (expired or deleted): the next occurrence
        makes a new one."""
        self._series.pop(series.name, None)
        if self._latest.get(series.text.key) is series:
            del self._latest[series.text.key]

    def next_due_in(self) -> float | None:
        """Seconds until a series patch may be written (its interval and a token), None
        when nothing is owed."""
        now = self.clock()
        owed = [s.written_at + self.patch_every - now for s in self._series.values() if s.owed]
        if not owed:
            return None
        return max(0.0, min(owed), self.budget.wait(now))

    def __len__(self) -> int:
        return len(self._series)

    def _forget(self, now: float) -> None:
        """Series past their window with nothing owed are done (one still owed is kept until
        its last patch, even once a newer Event took its key)."""
        for series in [s for s in self._series.values() if now - s.seen_at > self.series_window]:
            if not series.owed:
                self.forget(series)
