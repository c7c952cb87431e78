"""An answer as aligned tables for a terminal: a heading per kind of fact, numbers to the
right, `-` for what is not known."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import tzinfo

from gpuid_agent.history.answers import Answer
from gpuid_agent.history.times import show


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.3f}"


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int]) -> str:
    cells = [list(columns), *([c or "-" for c in r] for r in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for row in cells:
        parts = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _heading(answer: Answer, tz: tzinfo) -> str:
    if answer.question == "gpu":
        return f"GPU serial {answer.subject}"
    if answer.question == "pod":
        return f"pod {answer.subject}"
    span = (
        f"at {show(answer.at, tz)}"
        if answer.at is not None
        else f"from {show(answer.since, tz)} to {show(answer.until, tz)}"
    )
    if answer.question == "node":
        return f"{answer.subject} {span}"
    return f"GPU usage by {answer.by}, periods starting {span.removeprefix('at ')}"


def to_table(answer: Answer, tz: tzinfo) -> str:
    parts = [_heading(answer, tz)]
    if answer.question == "usage":
        rows = [
            [*(g or ("(idle)" if i == 0 else "") for i, g in enumerate(r.group)),
             _number(r.gpu_hours), _number(r.kwh)]
            for r in answer.usage
        ]  # fmt: skip
        total_hours = sum(r.gpu_hours for r in answer.usage)
        total_kwh = sum(r.kwh for r in answer.usage)
        rows.append(["total", *[""] * (len(answer.usage_columns) - 1),
                     _number(total_hours), _number(total_kwh)])  # fmt: skip
        columns: Sequence[str] = [c.upper() for c in answer.usage_columns] + ["GPU-HOURS", "KWH"]
        n = len(answer.usage_columns)
        parts.append(table(columns, rows, frozenset({n, n + 1})))
        return "\n\n".join(parts) + "\n"
    if answer.question != "pod":
        title = "GPUs on the node" if answer.question == "node" else "where it was"
        rows = [
            [
                show(p.first_seen, tz),
                show(p.last_seen, tz) + (" (left)" if p.removed else ""),
                p.node,
                p.chassis,
                ",".join(p.slots),
                p.serial,
                p.model,
            ]
            for p in answer.placements
        ]
        columns = ("FIRST SEEN", "LAST SEEN", "NODE", "CHASSIS", "SLOTS", "SERIAL", "MODEL")
        parts.append(f"{title}\n" + table(columns, rows, frozenset()))
    rows = [
        [
            show(h.started_at, tz),
            show(h.ended_at, tz) if h.ended_at else "(open)",
            f"{h.namespace}/{h.pod}",
            h.container,
            h.workload,
            h.node,
            h.chassis,
            h.slot,
            h.serial,
            _number(None if h.gpu_seconds is None else h.gpu_seconds / 3600),
            _number(None if h.energy_joules is None else h.energy_joules / 3_600_000),
        ]
        for h in answer.holdings
    ]
    columns = ("FROM", "TO", "POD", "CONTAINER", "WORKLOAD", "NODE", "CHASSIS", "SLOT", "SERIAL",
               "GPU-HOURS", "KWH")  # fmt: skip
    title = "GPUs it held" if answer.question == "pod" else "pods"
    parts.append(f"{title}\n" + table(columns, rows, frozenset({9, 10})))
    rows = [[show(m.time, tz), m.node, m.serial, m.kind, m.describe()] for m in answer.marks]
    parts.append("events\n" + table(("TIME", "NODE", "SERIAL", "KIND", "WHAT"), rows, frozenset()))
    return "\n\n".join(parts) + "\n"
