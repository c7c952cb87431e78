"""When the next /gpu/metrics scrape is due, learned from the scrapers' own cadence.

Prometheus scrapes each target at a fixed interval, so the scrapes of one scraper (one peer
address: a Prometheus pod, each replica of an HA pair its own) come at a steady period. Two
gaps in a row that agree make a period; from then on the next scrape is due one period after
the last. Anything irregular (a person with curl, a scraper that changed its interval) has
no period until two gaps agree again, and a scraper that missed two periods is no longer
expected. Requests less than `MIN_PERIOD` after the last one of the same scraper are bursts
(a retry, a second client behind one address), not a cadence: they leave it as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuid_agent.serving.gpu_metrics import Format

MIN_PERIOD = 1.0  # seconds; no scraper keeps a shorter interval
TOLERANCE = 0.1  # two gaps within 10 % of each other make a period
SCRAPERS = 16  # the most scrapers followed; the one heard from longest ago is forgotten
MISSED = 2  # periods a scraper may miss before it is no longer expected


@dataclass(slots=True)
class _Scraper:
    last: float  # when its last scrape came
    format: Format  # what it asked for then
    gap: float | None = None  # the gap before its last scrape
    period: float | None = None  # set while its last two gaps agree


@dataclass(frozen=True, slots=True)
class Due:
    at: float  # when the next scrape is expected
    format: Format  # what that scraper asks for


class ScrapeCadence:
    def __init__(self) -> None:
        self._scrapers: dict[str, _Scraper] = {}  # oldest heard from first

    def scraped(self, scraper: str, fmt: Format, now: float) -> None:
        """A scrape from `scraper` (its address) at `now` (loop time) asking for `fmt`."""
        known = self._scrapers.pop(scraper, None)
        if known is None:
            known = _Scraper(now, fmt)
        elif now - known.last >= MIN_PERIOD:
            gap = now - known.last
            steady = known.gap is not None and abs(gap - known.gap) <= TOLERANCE * known.gap
            known.period = gap if steady else None
            known.gap, known.last, known.format = gap, now, fmt
        self._scrapers[scraper] = known
        while len(self._scrapers) > SCRAPERS:
            del self._scrapers[next(iter(self._scrapers))]

    def next_due(self, now: float) -> Due | None:
        """The first scrape expected after `now`, or None if no scraper keeps a period."""
        first: Due | None = None
        for known in self._scrapers.values():
            if known.period is None:
                continue
            periods = max(1, math.ceil((now - known.last) / known.period))
            if periods > MISSED:
                continue
            at = known.last + periods * known.period
            if at <= now:  # exactly on a period's end: that one is taken as past
                at += known.period
            if first is None or at < first.at:
                first = Due(at, known.format)
        return first
