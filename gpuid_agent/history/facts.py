"""What the records say, in the form every source gives it: sightings (readings), holdings
(allocations), marks (health transitions, XIDs, replacements) and usage amounts; and the one
reading of a record's wire dict into them, tolerant of whatever a line holds."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

MarkKind = Literal["health", "xid", "replaced", "added", "moved"]
_XID = re.compile(r"\bXID (\d{1,5})\b")


@dataclass(frozen=True, slots=True)
class Sighting:
    """One reading: a GPU (by serial and UUID) seen in a slot of a node at a time."""

    time: datetime
    cluster: str
    node: str
    machine: str
    chassis: str
    serial: str
    uuid: str
    slot: str  # PCI bus id, "" when unknown
    model: str
    removed: bool  # the reading said the GPU left the node


@dataclass(frozen=True, slots=True)
class Holding:
    """One allocation of a GPU (or MIG device) to a container, with what it used: the end's
    totals once it ended, its usage records' sum while it is open (None: not accounted)."""

    allocation_id: str
    cluster: str
    node: str
    serial: str
    uuid: str
    mig_uuid: str
    namespace: str
    pod: str
    pod_uid: str
    container: str
    workload_kind: str
    workload_name: str
    started_at: datetime | None
    ended_at: datetime | None
    gpu_seconds: float | None
    energy_joules: float | None
    chassis: str = ""  # from the readings of its node, where found
    slot: str = ""

    @property
    def workload(self) -> str:
        return f"{self.workload_kind}/{self.workload_name}" if self.workload_name else ""


@dataclass(frozen=True, slots=True)
class Mark:
    """Something that happened to a GPU at a moment: a health transition (an XID's own kind
    when the check is `xid`), a replacement or addition, or a move between nodes."""

    time: datetime
    kind: MarkKind
    cluster: str
    node: str
    serial: str
    uuid: str
    chassis: str = ""
    slot: str = ""
    check: str = ""
    state: str = ""
    previous_state: str = ""
    action: str = ""
    reason: str = ""
    xid: int | None = None
    old_serial: str = ""
    new_serial: str = ""

    def describe(self) -> str:
        """One phrase saying what happened."""
        if self.kind in ("replaced", "added"):
            old = f"{self.old_serial} -> " if self.old_serial else ""
            return f"{self.kind} in {self.slot or 'a slot'}: {old}{self.new_serial or self.serial}"
        if self.kind == "moved":
            return self.reason
        change = f"{self.previous_state or 'new'} -> {self.state}"
        action = f", {self.action}" if self.action and self.action != "none" else ""
        reason = f": {self.reason}" if self.reason else ""
        return f"{self.check} {change}{action}{reason}"


@dataclass(frozen=True, slots=True)
class UsageAmount:
    """GPU-seconds and energy of one workload, summed over usage records."""

    namespace: str
    workload_kind: str
    workload_name: str
    gpu_seconds: float
    energy_joules: float


def text(value: Any) -> str:
    """A record's string field; anything else (a number, null, a list) as its text or ""."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, list | dict):
        return ""
    return str(value)


def number(value: Any) -> float | None:
    """A finite number, or None (a string, a bool, NaN, a missing field)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def moment(value: Any) -> datetime | None:
    """An RFC 3339 time as the records write it (`…Z`), aware; None if it is none."""
    if not isinstance(value, str) or not 10 <= len(value) <= 40:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def xid_of(reason: str) -> int | None:
    found = _XID.search(reason)
    return int(found.group(1)) if found else None


def sighting(wire: Mapping[str, Any]) -> Sighting | None:
    """A reading's wire dict as a sighting; None without a time."""
    when = moment(wire.get("read_time")) or moment(wire.get("time"))
    if when is None:
        return None
    return Sighting(
        time=when,
        cluster=text(wire.get("cluster")),
        node=text(wire.get("node")),
        machine=text(wire.get("machine")),
        chassis=text(wire.get("chassis")),
        serial=text(wire.get("gpu")),
        uuid=text(wire.get("uuid")),
        slot=text(wire.get("pci_bus_id")),
        model=text(wire.get("model")),
        removed=wire.get("change") == "removed",
    )


def mark(wire: Mapping[str, Any]) -> Mark | None:
    """A health or hardware record's wire dict as a mark; None without a time."""
    when = moment(wire.get("read_time"))
    kind = wire.get("kind")
    if when is None or kind not in ("health", "hardware"):
        return None
    cluster, node = text(wire.get("cluster")), text(wire.get("node"))
    serial, uuid, chassis = text(wire.get("gpu")), text(wire.get("uuid")), text(wire.get("chassis"))
    if kind == "hardware":
        return Mark(
            when,
            "added" if wire.get("event") == "added" else "replaced",
            cluster,
            node,
            serial,
            uuid,
            chassis,
            slot=text(wire.get("pci_bus_id")),
            old_serial=text(wire.get("old_serial")),
            new_serial=text(wire.get("new_serial")),
        )
    check = text(wire.get("check"))
    reason = text(wire.get("reason"))
    xid = xid_of(reason) if check == "xid" else None
    return Mark(
        when,
        "xid" if xid is not None else "health",
        cluster,
        node,
        serial,
        uuid,
        chassis,
        check=check,
        state=text(wire.get("state")),
        previous_state=text(wire.get("previous_state")),
        action=text(wire.get("action")),
        reason=reason,
        xid=xid,
    )


# The text fields of allocation records a holding is made of (besides the serial and times).
ALLOCATION_TEXT = (
    "cluster",
    "node",
    "uuid",
    "mig_uuid",
    "namespace",
    "pod",
    "pod_uid",
    "container",
    "workload_kind",
    "workload_name",
)


@dataclass(slots=True)
class AllocationRecords:
    """An allocation's records (start, end, usage; any order, re-sends included), gathered by
    allocation id into one holding."""

    fields: dict[str, str] = field(default_factory=dict)
    started: list[datetime] = field(default_factory=list)
    ended: list[datetime] = field(default_factory=list)
    end_totals: tuple[float | None, float | None] | None = None
    usage: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)

    def take(self, wire: Mapping[str, Any]) -> None:
        for name in ALLOCATION_TEXT:
            if not self.fields.get(name):
                self.fields[name] = text(wire.get(name))
        if not self.fields.get("serial"):
            self.fields["serial"] = text(wire.get("gpu")) or text(wire.get("serial"))
        started = moment(wire.get("started_at"))
        if started is not None:
            self.started.append(started)
        amounts = (number(wire.get("gpu_seconds")), number(wire.get("energy_joules")))
        event = wire.get("event")
        if event == "end":
            ended = moment(wire.get("ended_at"))
            if ended is not None:
                self.ended.append(ended)
            if self.end_totals is None or amounts[0] is not None:
                self.end_totals = amounts
        elif event == "usage":
            self.usage[text(wire.get("record_id"))] = amounts

    def holding(self, allocation_id: str) -> Holding:
        f = self.fields
        ended = min(self.ended) if self.ended else None
        if ended is not None and self.end_totals is not None:
            seconds, joules = self.end_totals
        elif self.usage:
            seconds = _sum(a[0] for a in self.usage.values())
            joules = _sum(a[1] for a in self.usage.values())
        else:
            seconds = joules = None
        return Holding(
            allocation_id=allocation_id,
            cluster=f["cluster"],
            node=f["node"],
            serial=f["serial"],
            uuid=f["uuid"],
            mig_uuid=f["mig_uuid"],
            namespace=f["namespace"],
            pod=f["pod"],
            pod_uid=f["pod_uid"],
            container=f["container"],
            workload_kind=f["workload_kind"],
            workload_name=f["workload_name"],
            started_at=min(self.started) if self.started else None,
            ended_at=ended,
            gpu_seconds=seconds,
            energy_joules=joules,
        )


def _sum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None
