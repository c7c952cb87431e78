"""What a source of records answers: the facts each question needs, selected by serial, by
node and time range, or by pod. PostgreSQL and DuckDB select in SQL through indexes and
partitions; a directory of records selects in memory."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from gpuid_agent.history.facts import Holding, Mark, Sighting, UsageAmount


@dataclass(frozen=True, slots=True)
class Where:
    """One selection: a serial, or a node between two times, or a pod; `cluster` narrows any."""

    serial: str | None = None
    node: str | None = None
    namespace: str | None = None
    pod: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    cluster: str | None = None


class Source(Protocol):
    """A store of records. Every method raises RecordsUnreachableError, naming the setting to
    fix, when the store cannot be read."""

    def sightings(self, where: Where) -> list[Sighting]:
        """Readings of `where.serial`, or of `where.node` in [since, until], in time order."""
        ...

    def holdings(self, where: Where) -> list[Holding]:
        """Allocations of `where.serial`, of `where.pod`, or on `where.node` that overlap
        [since, until]; an open one's amounts are its usage records' sum so far."""
        ...

    def marks(self, where: Where) -> list[Mark]:
        """Health and hardware records of `where.serial` (as the GPU or the one it replaced),
        or on `where.node` in [since, until]."""
        ...

    def usage(self, since: datetime, until: datetime, cluster: str | None) -> list[UsageAmount]:
        """Usage records whose period starts in [since, until) (whole hours), per workload."""
        ...

    def close(self) -> None: ...
