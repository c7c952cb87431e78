"""An answer laid out as a timeline: a row per GPU serial, grouped by chassis and node; on each
row the stays (when the GPU was under that node), a bar per allocation and a mark per event.
The page (`render_html`) draws it; this only decides what goes where."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpuid_agent.history.answers import Answer
from gpuid_agent.history.facts import Holding, Mark

NODE_ROW = "(node)"  # the row of marks about the node rather than one GPU


@dataclass(slots=True)
class Row:
    serial: str
    slots: set[str] = field(default_factory=set)
    stays: list[tuple[datetime, datetime]] = field(default_factory=list)
    bars: list[Holding] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.serial} {','.join(sorted(self.slots))}".strip()


@dataclass(slots=True)
class Group:
    chassis: str
    node: str
    rows: dict[str, Row] = field(default_factory=dict)

    def row(self, serial: str) -> Row:
        return self.rows.setdefault(serial, Row(serial))


@dataclass(frozen=True, slots=True)
class Timeline:
    start: datetime
    end: datetime
    groups: tuple[Group, ...]
    namespaces: tuple[str, ...]  # by time held, most first: the legend's order

    @property
    def rows(self) -> int:
        return sum(len(g.rows) for g in self.groups)

    @property
    def bars(self) -> int:
        return sum(len(r.bars) for g in self.groups for r in g.rows.values())


def _times(answer: Answer) -> Iterable[datetime]:
    for p in answer.placements:
        yield p.first_seen
        yield p.last_seen
    for h in answer.holdings:
        yield from (t for t in (h.started_at, h.ended_at) if t is not None)
    for m in answer.marks:
        yield m.time
    yield from (t for t in (answer.since, answer.until, answer.at) if t is not None)


def bounds(answer: Answer) -> tuple[datetime, datetime]:
    """The span drawn: what was asked, widened to what was found; at least an hour."""
    times = sorted(_times(answer))
    start, end = times[0], times[-1]
    if answer.since is not None and answer.until is not None:
        start, end = answer.since, answer.until
    if end - start < timedelta(hours=1):
        end = start + timedelta(hours=1)
    return start, end


def layout(answer: Answer) -> Timeline:
    groups: dict[tuple[str, str], Group] = {}
    node_chassis: dict[str, str] = {}

    def group(node: str, chassis: str) -> Group:
        chassis = chassis or node_chassis.get(node, "")
        return groups.setdefault((chassis, node), Group(chassis, node))

    for p in answer.placements:
        node_chassis.setdefault(p.node, p.chassis)
        row = group(p.node, p.chassis).row(p.serial)
        row.slots.update(p.slots)
        row.stays.append((p.first_seen, p.last_seen))
    held: dict[str, float] = {}
    for h in answer.holdings:
        row = group(h.node, h.chassis).row(h.serial or h.uuid)
        if h.slot:
            row.slots.add(h.slot)
        row.bars.append(h)
        if h.started_at is not None:
            end = h.ended_at or answer.until or answer.at or h.started_at
            spent = (end - h.started_at).total_seconds()
            held[h.namespace] = held.get(h.namespace, 0.0) + spent
    for m in answer.marks:
        target = group(m.node, m.chassis)
        serial = m.serial or (m.new_serial if m.kind in ("replaced", "added") else "")
        if answer.question == "gpu":  # on the GPU asked about, whether it came or left
            serial = answer.subject
        target.row(serial or NODE_ROW).marks.append(m)
    start, end = bounds(answer)
    ordered = tuple(
        Group(g.chassis, g.node, dict(sorted(g.rows.items(), key=lambda kv: _row_order(kv[1]))))
        for _, g in sorted(groups.items())
    )
    namespaces = tuple(sorted(held, key=lambda ns: (-held[ns], ns)))
    return Timeline(start, end, ordered, namespaces)


def _row_order(row: Row) -> tuple[bool, str, str]:
    return (row.serial == NODE_ROW, ",".join(sorted(row.slots)), row.serial)
