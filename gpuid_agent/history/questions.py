"""The four questions, asked of any source: the facts each needs, put together into answers.

A node "at" a moment holds, in each slot, the GPU of its latest reading there within the day
before (unless that reading said it left); its pods are the allocations open at that moment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from gpuid_agent.history.answers import Answer, Placement, UsageBy, UsageRow
from gpuid_agent.history.facts import Holding, Mark
from gpuid_agent.history.source import Source, Where
from gpuid_agent.history.stays import located, moves, stays
from gpuid_agent.runtime.errors import NotFoundError

# How far back a node's readings are looked for: a heartbeat (HEARTBEAT_INTERVAL, 1h by
# default) always falls within it.
LOOKBACK = timedelta(days=1)


def _in_order(marks: list[Mark]) -> tuple[Mark, ...]:
    return tuple(sorted(marks, key=lambda m: (m.time, m.node, m.serial, m.kind)))


def _held(holdings: list[Holding]) -> list[Holding]:
    """Pods' holdings: not a GPU's idle time, which its usage records carry as nobody's
    (namespace and pod empty) so that a node's records add up to its GPUs' time."""
    return [h for h in holdings if h.namespace or h.pod]


def gpu(source: Source, serial: str, cluster: str | None = None) -> Answer:
    where = Where(serial=serial, cluster=cluster)
    seen = source.sightings(where)
    held = _held(source.holdings(where))
    marks = source.marks(where)
    if not (seen or held or marks):
        raise NotFoundError(f"GPU serial {serial}: no readings, allocations or health records")
    placements = stays(seen)
    return Answer(
        question="gpu",
        subject=serial,
        placements=tuple(placements),
        holdings=tuple(located(held, seen)),
        marks=_in_order(marks + moves(placements)),
    )


def node(
    source: Source,
    names: Sequence[str],
    *,
    at: datetime | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    cluster: str | None = None,
) -> Answer:
    """The nodes at `at`, or over [since, until] (one of the two): several nodes (the trays
    of a rack) make one timeline."""
    start, end = (at, at) if at is not None else (since, until)
    if start is None or end is None:
        raise ValueError("a node is asked about at a moment or over a range")
    placements: list[Placement] = []
    holdings: list[Holding] = []
    marks: list[Mark] = []
    missing = []
    for name in names:
        seen = source.sightings(
            Where(node=name, since=start - LOOKBACK, until=end, cluster=cluster)
        )
        held = _held(source.holdings(Where(node=name, since=start, until=end, cluster=cluster)))
        found = source.marks(
            Where(node=name, since=start - LOOKBACK if at else start, until=end, cluster=cluster)
        )
        if at is not None:
            held = [h for h in held if _open_at(h, at)]
        if not (seen or held or found):
            missing.append(name)
            continue
        stayed = stays(seen)
        if at is not None:
            placements += _current(stayed)
        else:
            placements += [p for p in stayed if p.last_seen >= start]
        holdings += located(held, seen)
        marks += found + moves(stayed)
    if missing:
        when = f"in the day before {at.isoformat()}" if at else "in that range"
        raise NotFoundError(f"node {', '.join(missing)}: no records {when}")
    return Answer(
        question="node",
        subject=_nodes(names),
        since=since,
        until=until,
        at=at,
        placements=tuple(placements),
        holdings=tuple(holdings),
        marks=_in_order(marks),
    )


def _nodes(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"node {names[0]}"
    if len(names) <= 3:
        return "nodes " + ", ".join(names)
    return f"{len(names)} nodes, {names[0]} to {names[-1]}"


def _open_at(h: Holding, at: datetime) -> bool:
    started = h.started_at is None or h.started_at <= at
    return started and (h.ended_at is None or h.ended_at > at)


def _current(placements: list[Placement]) -> list[Placement]:
    """The latest stay in each slot (each UUID where no slot is known), unless it ended by
    the GPU leaving."""
    latest: dict[str, Placement] = {}
    for p in sorted(placements, key=lambda p: p.last_seen):
        for where in p.slots or p.uuids or (p.serial,):
            latest[where] = p
    kept = {id(p): p for p in latest.values() if not p.removed}
    return sorted(kept.values(), key=lambda p: (p.chassis, p.slots, p.serial))


def pod(source: Source, namespace: str, name: str, cluster: str | None = None) -> Answer:
    held = source.holdings(Where(namespace=namespace, pod=name, cluster=cluster))
    if not held:
        raise NotFoundError(f"pod {namespace}/{name}: no allocation records")
    seen, marks = [], []
    by_node: dict[str, list[Holding]] = {}
    for h in held:
        by_node.setdefault(h.node, []).append(h)
    for node_name, on_node in by_node.items():
        starts = [h.started_at for h in on_node if h.started_at is not None]
        if not starts:
            continue
        ends = [h.ended_at for h in on_node]
        end = None if None in ends else max(e for e in ends if e is not None)
        seen += source.sightings(
            Where(node=node_name, since=min(starts) - LOOKBACK, until=max(starts), cluster=cluster)
        )
        serials = {h.serial for h in on_node}
        marks += [
            m
            for m in source.marks(Where(node=node_name, since=min(starts), until=end))
            if m.serial in serials and any(_during(m, h) for h in on_node)
        ]
    return Answer(
        question="pod",
        subject=f"{namespace}/{name}",
        holdings=tuple(located(held, seen)),
        marks=_in_order(marks),
    )


def _during(m: Mark, h: Holding) -> bool:
    return (
        m.serial == h.serial
        and (h.started_at is None or m.time >= h.started_at)
        and (h.ended_at is None or m.time <= h.ended_at)
    )


NO_TEAM = "(no team)"
USAGE_COLUMNS: dict[UsageBy, tuple[str, ...]] = {
    "namespace": ("namespace",),
    "workload": ("namespace", "workload"),
    "team": ("team",),
}


def usage(
    source: Source,
    by: UsageBy,
    since: datetime,
    until: datetime,
    *,
    teams: Mapping[str, str] | None = None,
    cluster: str | None = None,
) -> Answer:
    """GPU-hours and kWh per group, of the usage records whose period starts in
    [since, until); `teams` maps a namespace, or `namespace/workload name`, to a team. A
    GPU's idle time (usage records of nobody: the namespace empty) is a group of its own."""
    totals: dict[tuple[str, ...], list[float]] = {}
    for amount in source.usage(since, until, cluster):
        if not (amount.gpu_seconds or amount.energy_joules):
            continue  # a rollup row whose hours all lie outside the range
        if by == "namespace":
            group: tuple[str, ...] = (amount.namespace,)
        elif by == "workload":
            workload = (
                f"{amount.workload_kind}/{amount.workload_name}" if amount.workload_name else ""
            )
            group = (amount.namespace, workload)
        elif not amount.namespace:  # a GPU's idle time: nobody's, no team's
            group = ("",)
        else:
            mapping = teams or {}
            team = mapping.get(f"{amount.namespace}/{amount.workload_name}")
            group = (team or mapping.get(amount.namespace) or NO_TEAM,)
        sums = totals.setdefault(group, [0.0, 0.0])
        sums[0] += amount.gpu_seconds
        sums[1] += amount.energy_joules
    if not totals:
        raise NotFoundError(
            f"no usage records with a period starting between {since.isoformat()} "
            f"and {until.isoformat()}"
        )
    rows = sorted(
        (UsageRow(group, seconds, joules) for group, (seconds, joules) in totals.items()),
        key=lambda r: (-r.gpu_seconds, r.group),
    )
    return Answer(
        question="usage",
        subject=f"usage by {by}",
        since=since,
        until=until,
        usage=tuple(rows),
        usage_columns=USAGE_COLUMNS[by],
        by=by,
    )
