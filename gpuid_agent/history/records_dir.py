"""A directory of records as the stdout exporter writes them: files of JSON lines, one record
a line (gzip files too), read once and selected in memory.

A line that is no record (not JSON, not an object with a known `kind`, a reading without a
time) is skipped and counted; `skipped` and `first_skipped` say so for one line on stderr.
A record seen twice (the same `record_id`: a re-send) counts once.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from gpuid_agent.history.facts import (
    AllocationRecords,
    Holding,
    Mark,
    Sighting,
    UsageAmount,
    mark,
    moment,
    number,
    sighting,
    text,
)
from gpuid_agent.history.source import Where
from gpuid_agent.runtime.errors import RecordsUnreachableError


@dataclass(frozen=True, slots=True)
class _Usage:
    start: datetime
    cluster: str
    amount: UsageAmount


class RecordsDirectory:
    """Every record under `root`, read at the first question."""

    name = "records directory"

    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.skipped = 0
        self.first_skipped = ""
        self._loaded = False
        self._seen: set[str] = set()
        self._sightings: list[Sighting] = []
        self._marks: list[Mark] = []
        self._allocations: dict[str, AllocationRecords] = {}
        self._usage: list[_Usage] = []

    def _files(self) -> list[Path]:
        if not self.root.is_dir():
            raise RecordsUnreachableError(f"--records {self.root}: no such directory")
        found = []
        for folder, _, names in os.walk(self.root):
            found += [Path(folder, n) for n in names if Path(folder, n).is_file()]
        return sorted(found)

    def _lines(self, path: Path) -> Iterator[bytes]:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as fh:
                yield from fh
        except (OSError, EOFError) as exc:
            raise RecordsUnreachableError(f"--records: cannot read {path}: {exc}") from exc

    def _skip(self, path: Path, number_: int) -> None:
        self.skipped += 1
        if not self.first_skipped:
            self.first_skipped = f"{path}:{number_}"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for path in self._files():
            for i, line in enumerate(self._lines(path), 1):
                if line.strip() and not self._take(line):
                    self._skip(path, i)
        self._sightings.sort(key=lambda s: s.time)
        self._marks.sort(key=lambda m: m.time)

    def _take(self, line: bytes) -> bool:
        """One line; False when it is no record."""
        try:
            wire = orjson.loads(line)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(wire, dict) or wire.get("kind") not in (
            "reading",
            "allocation",
            "health",
            "hardware",
        ):
            return False
        record_id = text(wire.get("record_id"))
        if record_id:
            if record_id in self._seen:
                return True
            self._seen.add(record_id)
        kind = wire["kind"]
        if kind == "reading":
            seen = sighting(wire)
            if seen is None:
                return False
            self._sightings.append(seen)
        elif kind == "allocation":
            return self._allocation(wire)
        else:
            found = mark(wire)
            if found is None:
                return False
            self._marks.append(found)
        return True

    def _allocation(self, wire: dict[str, Any]) -> bool:
        allocation_id = text(wire.get("allocation_id"))
        if not allocation_id:
            return False
        self._allocations.setdefault(allocation_id, AllocationRecords()).take(wire)
        start = moment(wire.get("usage_start"))
        if wire.get("event") == "usage" and start is not None:
            amount = UsageAmount(
                namespace=text(wire.get("namespace")),
                workload_kind=text(wire.get("workload_kind")),
                workload_name=text(wire.get("workload_name")),
                gpu_seconds=number(wire.get("gpu_seconds")) or 0.0,
                energy_joules=number(wire.get("energy_joules")) or 0.0,
            )
            self._usage.append(_Usage(start, text(wire.get("cluster")), amount))
        return True

    # ---- the Source protocol -------------------------------------------------------------

    def sightings(self, where: Where) -> list[Sighting]:
        self._load()
        return [s for s in self._sightings if _matches(where, s.cluster, s.node, s.serial, s.time)]

    def holdings(self, where: Where) -> list[Holding]:
        self._load()
        found = []
        for allocation_id, gathered in self._allocations.items():
            held = gathered.holding(allocation_id)
            if where.cluster is not None and held.cluster != where.cluster:
                continue
            if where.pod is not None:
                if (held.namespace, held.pod) == (where.namespace, where.pod):
                    found.append(held)
            elif where.serial is not None:
                if held.serial == where.serial:
                    found.append(held)
            elif held.node == where.node and _overlaps(held, where):
                found.append(held)
        return sorted(found, key=lambda h: (h.started_at is None, h.started_at, h.allocation_id))

    def marks(self, where: Where) -> list[Mark]:
        self._load()
        if where.serial is not None:
            return [
                m
                for m in self._marks
                if where.serial in (m.serial, m.old_serial)
                and (where.cluster is None or m.cluster == where.cluster)
            ]
        return [m for m in self._marks if _matches(where, m.cluster, m.node, None, m.time)]

    def usage(self, since: datetime, until: datetime, cluster: str | None) -> list[UsageAmount]:
        self._load()
        totals: dict[tuple[str, str, str], list[float]] = {}
        for used in self._usage:
            if not since <= used.start < until or (cluster is not None and used.cluster != cluster):
                continue
            a = used.amount
            sums = totals.setdefault((a.namespace, a.workload_kind, a.workload_name), [0.0, 0.0])
            sums[0] += a.gpu_seconds
            sums[1] += a.energy_joules
        return [UsageAmount(*key, *sums) for key, sums in sorted(totals.items())]

    def close(self) -> None:
        return None


def _matches(where: Where, cluster: str, node: str, serial: str | None, when: datetime) -> bool:
    if where.cluster is not None and cluster != where.cluster:
        return False
    if where.serial is not None:
        return serial == where.serial
    if node != where.node:
        return False
    return (where.since is None or when >= where.since) and (
        where.until is None or when <= where.until
    )


def _overlaps(held: Holding, where: Where) -> bool:
    if held.started_at is not None and where.until is not None and held.started_at > where.until:
        return False
    return not (
        held.ended_at is not None and where.since is not None and held.ended_at < where.since
    )
