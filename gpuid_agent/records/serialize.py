"""The one serializer: a typed record to the wire dict (and back, for the trail's state)."""

from __future__ import annotations

import hashlib
from dataclasses import MISSING, fields
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

import orjson

from gpuid_agent.records.types import (
    AllocationRecord,
    AnyRecord,
    HardwareRecord,
    HealthRecord,
    ReadingRecord,
)

Record = dict[str, Any]
_ALLOCATION_FIELDS = tuple(f.name for f in fields(AllocationRecord))
_ALLOCATION_REQUIRED = tuple(f.name for f in fields(AllocationRecord) if f.default is MISSING)
_CLAIM_FIELDS = ("claim_namespace", "claim_name", "claim_source")
# One C-level getter per type: records are built per GPU per collection, so this path is hot.
_GETTERS = {
    cls: (cls.__slots__, attrgetter(*cls.__slots__))
    for cls in (ReadingRecord, AllocationRecord, HealthRecord, HardwareRecord)
}


def rfc3339(moment: datetime) -> str:
    """UTC RFC 3339 with millisecond precision and a Z suffix."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def record_id(record: Record) -> str:
    """Deterministic id over every field but the id itself (sorted keys, canonical JSON)."""
    body = {k: v for k, v in record.items() if k != "record_id"}
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return digest[:32]


def to_wire(record: AnyRecord) -> Record:
    """The dict exporters and the spool receive; same names, values and ids as ever."""
    names, get = _GETTERS[type(record)]
    wire: Record = dict(zip(names, get(record), strict=True))
    if isinstance(record, HardwareRecord):
        return wire  # its id is carried: it names the change, not the moment it was seen
    if isinstance(record, AllocationRecord):
        if record.end_observed is not False:
            del wire["last_seen_at"]  # only an unseen end carries it
        if record.claim_name is None:
            for name in _CLAIM_FIELDS:  # not a DRA allocation: the wire is as it always was
                del wire[name]
        return wire
    if isinstance(record, ReadingRecord):
        wire["mig_devices"] = list(record.mig_devices)
    elif isinstance(record, HealthRecord):
        if record.holders:
            wire["holders"] = [dict(h) for h in record.holders]
        else:
            del wire["holders"]  # only a GPU someone held carries it: ids stay as they were
    wire["record_id"] = _content_id(wire)
    return wire


def _content_id(wire: Record) -> str:
    digest = hashlib.sha256(orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return digest[:32]


def allocation_from_wire(wire: Record) -> AllocationRecord:
    """An allocation record back from its wire dict (the trail's state file holds those)."""
    missing = [name for name in _ALLOCATION_REQUIRED if name not in wire]
    if missing:
        raise ValueError(f"allocation record lacks {', '.join(missing)}")
    return AllocationRecord(**{k: wire[k] for k in _ALLOCATION_FIELDS if k in wire})
