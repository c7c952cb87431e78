"""Usage records: what an open allocation used (GPU-seconds, energy) per accounting period,
so billing never waits for a job to end, and the totals its end record carries.

Periods are ACCOUNTING_INTERVAL long, aligned to multiples of it since the epoch (UTC). Once
an allocation is open past a period's end, the next flush emits one `event: usage` record
for what it used since its last one (or its start); its end emits the last, partial one.
The usage records of an allocation therefore add up to its end's `gpu_seconds` and
`energy_joules`. A usage record's id hashes (allocation_id, period), so a re-send after a
restart is the same row.

The amounts come from the collector's accounting (state/accounting.py): each holding's total
since the agent (or its state file) started; a mark per open allocation keeps where its
records stand (`[since, period, base seconds, base joules, carried seconds, carried joules]`,
the base being the holding's total at the start). The marks are saved in the allocation
state file with the records they owe, so a kill between the two neither loses nor repeats
a period.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from gpuid_agent.records.serialize import allocation_from_wire, rfc3339
from gpuid_agent.records.types import AllocationRecord
from gpuid_agent.state.accounting_split import NO_ACCOUNTING, AccountingView, HoldingKey
from gpuid_agent.state.state_file import WireRecord

Mark = list[Any]  # [since, period, base_s, base_j, carried_s, carried_j]


def holding_of(start: WireRecord) -> HoldingKey:
    """The accounting holding an allocation's start record names."""
    device = start.get("mig_uuid") or start.get("uuid") or ""
    return (
        str(start.get("namespace") or ""),
        str(start.get("pod") or ""),
        str(start.get("pod_uid") or ""),
        str(start.get("container") or ""),
        str(device),
    )


def _round(value: float) -> float:
    return round(value, 3)


class UsageLedger:
    """Marks of the open allocations (the state file's `usage`), read against the latest
    accounting view."""

    def __init__(
        self, interval: float, marks: dict[str, Mark], record_id: Callable[[str, str], str]
    ) -> None:
        self.interval = interval
        self.marks = marks
        self._record_id = record_id  # (allocation_id, event) → the record's id
        self.view: AccountingView = NO_ACCOUNTING

    def period(self, now: datetime) -> int:
        return int(now.timestamp() // self.interval)

    def _total(
        self, start: WireRecord, open_records: Iterable[WireRecord]
    ) -> tuple[float, float | None] | None:
        key = holding_of(start)
        usage = self.view.holding(key)
        if usage is None:
            return None
        # a container holding several replicas of one device: each allocation its part
        sharing = sum(1 for r in open_records if holding_of(r) == key) or 1
        joules = None if usage.energy_joules is None else usage.energy_joules / sharing
        return usage.gpu_seconds / sharing, joules

    def opened(self, start: WireRecord, now: datetime, open_records: Sequence[WireRecord]) -> None:
        total = self._total(start, open_records) or (0.0, None)
        self.marks[start["allocation_id"]] = [rfc3339(now), self.period(now), *total, 0.0, 0.0]

    def _mark(self, start: WireRecord, now: datetime, open_records: Sequence[WireRecord]) -> Mark:
        mark = self.marks.get(start["allocation_id"])
        if mark is None:  # open before marks were kept: counted from now
            self.opened(start, now, open_records)
            mark = self.marks[start["allocation_id"]]
        return mark

    def _record(
        self, start: WireRecord, now: datetime, open_records: Sequence[WireRecord]
    ) -> AllocationRecord | None:
        """The usage record owed since the mark, the mark moved on; None without figures."""
        mark = self._mark(start, now, open_records)
        total = self._total(start, open_records)
        since, period, base_s, base_j, carried_s, carried_j = mark
        if total is None:
            return None
        seconds = max(0.0, total[0] - base_s - carried_s)
        joules = None
        if total[1] is not None:
            joules = max(0.0, total[1] - (base_j or 0.0) - carried_j)
            mark[5] = carried_j + joules
        mark[4] = carried_s + seconds
        mark[0], mark[1] = rfc3339(now), self.period(now)
        begun = allocation_from_wire(start)
        return replace(
            begun,
            record_id=self._record_id(begun.allocation_id, f"usage:{period}"),
            event="usage",
            read_time=rfc3339(now),
            gpu_seconds=_round(seconds),
            energy_joules=None if joules is None else _round(joules),
            usage_start=since,
        )

    def due(self, open_records: Sequence[WireRecord], now: datetime) -> list[AllocationRecord]:
        """Usage records of the open allocations whose period ended since their mark."""
        period = self.period(now)
        out: list[AllocationRecord] = []
        for start in open_records:
            mark = self._mark(start, now, open_records)
            if period > mark[1] and (record := self._record(start, now, open_records)):
                out.append(record)
        return out

    def closed(
        self, start: WireRecord, now: datetime, open_records: Sequence[WireRecord]
    ) -> tuple[AllocationRecord | None, float | None, float | None]:
        """An ending allocation's last usage record and its totals (None: not accounted)."""
        record = self._record(start, now, [*open_records, start])
        mark = self.marks.pop(start["allocation_id"], None)
        if mark is None or (record is None and not (mark[4] or mark[5])):
            return None, None, None  # never accounted (accounting had no figures for it)
        joules = _round(mark[5]) if mark[3] is not None or mark[5] else None
        return record, _round(mark[4]), joules
