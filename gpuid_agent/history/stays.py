"""Readings turned into stays (a GPU under one node, machine and chassis, from when to when)
and the moves between them.

A stay is a run of a serial's readings under one (cluster, node, machine, chassis). It ends
where a reading says the GPU left, or where the serial was read elsewhere while this node,
usually reporting it every interval, did not for more than twice that interval (at least two
hours): a GPU that went to another node and came back is two stays, while a serial two nodes
report at once (serials are not always unique) stays one stay on each.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta

from gpuid_agent.history.answers import Placement
from gpuid_agent.history.facts import Holding, Mark, Sighting

_Key = tuple[str, str, str, str]
_MIN_GAP = timedelta(hours=2)


def _key(s: Sighting) -> _Key:
    return (s.cluster, s.node, s.machine, s.chassis)


def _placement(run: Sequence[Sighting]) -> Placement:
    first = run[0]
    return Placement(
        serial=first.serial,
        cluster=first.cluster,
        node=first.node,
        machine=first.machine,
        chassis=first.chassis,
        slots=tuple(sorted({s.slot for s in run if s.slot})),
        uuids=tuple(sorted({s.uuid for s in run if s.uuid})),
        model=next((s.model for s in run if s.model), ""),
        first_seen=first.time,
        last_seen=run[-1].time,
        removed=run[-1].removed,
    )


def _usual_gap(times: Sequence[datetime]) -> timedelta:
    distinct = sorted(set(times))
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(distinct)]
    usual = timedelta(seconds=statistics.median(gaps)) if gaps else timedelta(0)
    return max(2 * usual, _MIN_GAP)


def stays(sightings: Sequence[Sighting]) -> list[Placement]:
    """The stays of the sightings (any serials), in order of their start."""
    ordered = sorted(sightings, key=lambda s: s.time)
    by_key: dict[tuple[str, _Key], list[Sighting]] = {}
    for s in ordered:
        by_key.setdefault((s.serial, _key(s)), []).append(s)
    # every serial's readings by time, to see whether it was read elsewhere in a gap
    elsewhere: dict[str, list[tuple[datetime, _Key]]] = {}
    for s in ordered:
        elsewhere.setdefault(s.serial, []).append((s.time, _key(s)))
    out: list[Placement] = []
    for (serial, key), seen in by_key.items():
        limit = _usual_gap([s.time for s in seen])
        others = elsewhere[serial]
        run: list[Sighting] = []
        for s in seen:
            if run and (run[-1].removed or _left(run[-1].time, s.time, key, limit, others)):
                out.append(_placement(run))
                run = []
            run.append(s)
        out.append(_placement(run))
    return sorted(out, key=lambda p: (p.first_seen, p.node, p.serial))


def _left(
    before: datetime,
    after: datetime,
    key: _Key,
    limit: timedelta,
    others: list[tuple[datetime, _Key]],
) -> bool:
    if after - before <= limit:
        return False
    lo = bisect.bisect_right(others, before, key=lambda o: o[0])
    hi = bisect.bisect_left(others, after, key=lambda o: o[0])
    return any(k != key for _, k in others[lo:hi])


def moves(placements: Sequence[Placement]) -> list[Mark]:
    """A mark where a serial's stay follows one under another node or in other slots."""
    marks = []
    by_serial: dict[str, list[Placement]] = {}
    for p in placements:
        by_serial.setdefault(p.serial, []).append(p)
    for serial, stays_of in by_serial.items():
        for before, after in itertools.pairwise(stays_of):
            if (before.node, before.slots) == (after.node, after.slots):
                continue
            marks.append(
                Mark(
                    time=after.first_seen,
                    kind="moved",
                    cluster=after.cluster,
                    node=after.node,
                    serial=serial,
                    uuid=after.uuids[0] if after.uuids else "",
                    chassis=after.chassis,
                    slot=",".join(after.slots),
                    reason=f"moved from {_where(before)} to {_where(after)}",
                )
            )
    return marks


def _where(p: Placement) -> str:
    slots = f" {','.join(p.slots)}" if p.slots else ""
    return f"{p.node}{slots}"


def located(holdings: Sequence[Holding], sightings: Sequence[Sighting]) -> list[Holding]:
    """Each holding with the chassis and slot of its GPU: the latest reading of its UUID (else
    its serial) on its node at or before the holding's start, else the first after."""
    by_gpu: dict[tuple[str, str], list[Sighting]] = {}
    for s in sorted(sightings, key=lambda s: s.time):
        by_gpu.setdefault((s.node, s.uuid), []).append(s)
        by_gpu.setdefault((s.node, s.serial), []).append(s)
    out = []
    for h in holdings:
        candidates = by_gpu.get((h.node, h.uuid or h.serial), [])
        if not candidates:
            out.append(h)
            continue
        start = h.started_at
        before = (
            len(candidates)
            if start is None
            else bisect.bisect_right(candidates, start, key=lambda s: s.time)
        )
        chosen = candidates[before - 1] if before else candidates[0]
        out.append(replace(h, chassis=chosen.chassis, slot=chosen.slot))
    return out
