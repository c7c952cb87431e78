"""Records → table rows, tolerant of anything a record may hold.

Strings lose NUL characters and invalid surrogates (PostgreSQL text cannot hold them) and are
cut to the column's width; integers outside INT range become NULL. Whatever had to be changed
or had no column is kept verbatim (JSON) in the row's `attributes`, so nothing is lost. A
reading that cannot fill the readings table (no readable read_time) goes to the events table.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from gpuid_agent.records import columns
from gpuid_agent.records.serialize import Wire, json_bytes, to_wire
from gpuid_agent.records.types import AnyRecord

VARCHAR = 255
INT_MIN, INT_MAX = -(2**31), 2**31 - 1

READING_COLUMNS = tuple(c.name for c in columns.READINGS)
ALLOCATION_COLUMNS = tuple(c.name for c in columns.ALLOCATIONS)
EVENT_COLUMNS = ("record_id", "kind", "cluster", "node", "machine", "observed_at", "payload")

# allocation column → record fields that may carry it, first match wins
_ALLOCATION_FIELDS: dict[str, tuple[str, ...]] = {
    "cluster": ("cluster",),
    "node": ("node",),
    "machine": ("machine",),
    "gpu": ("gpu", "serial"),
    "uuid": ("uuid", "gpu_uuid"),
    "mig_uuid": ("mig_uuid", "mig_id", "mig_device"),
    "namespace": ("namespace",),
    "pod": ("pod", "pod_name"),
    "pod_uid": ("pod_uid",),
    "container": ("container",),
    "resource_name": ("resource_name", "resource"),
    "device_id": ("device_id",),
    "workload_kind": ("workload_kind",),
    "workload_name": ("workload_name",),
    "claim_namespace": ("claim_namespace",),
    "claim_name": ("claim_name",),
    "claim_source": ("claim_source",),
}
_TIME_FIELDS = ("read_time", "time", "observed_at", "timestamp", "started_at")


def clean_text(value: str, limit: int | None = VARCHAR) -> str:
    if value.isascii():  # the common case: only NULs can be wrong
        text = value.replace("\x00", "") if "\x00" in value else value
    else:
        text = value.replace("\x00", "")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates
            text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:limit] if limit is not None and len(text) > limit else text


def _text(value: Any, limit: int = VARCHAR) -> str | None:
    if value.__class__ is str:
        return clean_text(value, limit)
    if value is None:
        return None
    if isinstance(value, bool | int | float):
        value = str(value).lower() if isinstance(value, bool) else str(value)
    if not isinstance(value, str):
        return None
    return clean_text(value, limit)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if INT_MIN <= value <= INT_MAX else None


@functools.lru_cache(maxsize=1024)  # a snapshot's records share one read_time
def _parse_time_text(value: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(value.replace("z", "Z"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        moment.astimezone(UTC)
    except (OverflowError, ValueError):
        return None
    return moment


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 / ISO 8601 time (naive ones are UTC); None when unreadable."""
    if not isinstance(value, str) or not 10 <= len(value) <= 64:
        return None
    return _parse_time_text(value)


def _clean_json(value: Any) -> Any:
    """JSON-safe for jsonb: no NUL characters (jsonb refuses \\u0000), no lone surrogates."""
    if isinstance(value, str):
        return clean_text(value, None)
    if isinstance(value, dict):
        return {clean_text(str(k), None): _clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean_json(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        return str(value)  # orjson refuses integers beyond 64 bits
    if isinstance(value, float) and math.isnan(value):  # NaN is not JSON
        return None
    return value


def to_json(value: Any) -> str:
    return json_bytes(_clean_json(value)).decode("utf-8")


def fallback_id(record: Wire) -> str:
    body = _clean_json({k: v for k, v in record.items() if k != "record_id"})
    digest = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS, default=str))
    return digest.hexdigest()[:32]


def _record_id(record: Wire) -> str:
    value = _text(record.get("record_id"))
    return value if value else fallback_id(record)


_TEXT, _TEXT_NOT_NULL, _INT, _LIST, _TIME, _ID = range(6)


def _how(column: columns.Column) -> int:
    if column.name == "record_id":
        return _ID
    head = column.sql.split("(")[0].split()[0]
    if head == "TIMESTAMP":
        return _TIME
    if head == "INTEGER":
        return _INT
    if head == "TEXT[]":
        return _LIST
    return _TEXT_NOT_NULL if "NOT NULL" in column.sql else _TEXT


# (record field, how its column takes it), in READING_COLUMNS order up to `attributes`
_READING_SPEC: tuple[tuple[str, int], ...] = tuple(
    (c.source, _how(c)) for c in columns.READINGS if c.name != "attributes"
)
_READING_KNOWN = frozenset(name for name, _ in _READING_SPEC) | {"kind"}


def reading_row(record: Wire) -> tuple[Any, ...] | None:
    """The readings-table row of a reading, or None when it has no readable read_time.

    Written for speed (it runs for every record of a backlog): plain short ASCII strings,
    the usual case, are taken as they are; anything else goes through the careful path."""
    get = record.get
    read_time = parse_time(get("read_time"))
    if read_time is None:
        return None
    extra: dict[str, Any] = {}
    if not record.keys() <= _READING_KNOWN:
        extra = {k: v for k, v in record.items() if k not in _READING_KNOWN}
    row: list[Any] = []
    append = row.append
    for name, kind in _READING_SPEC:
        value = get(name)
        if kind <= _TEXT_NOT_NULL:
            if (
                value.__class__ is str
                and len(value) <= VARCHAR
                and value.isascii()
                and "\x00" not in value
            ):
                append(value)
                continue
            converted: Any = _text(value)
            if converted is None and kind == _TEXT_NOT_NULL:
                converted = ""
        elif kind == _TIME:
            append(read_time)
            continue
        elif kind == _ID:
            append(_record_id(record))
            continue
        elif kind == _INT:
            converted = _int(value)
        else:  # _LIST
            converted = [_text(v) or "" for v in value] if isinstance(value, list) else None
        if value is not None and converted != value:
            extra[name] = value  # changed on the way in: keep the original
        append(converted)
    append(to_json(extra) if extra else None)
    return tuple(row)


def allocation_id(record: Wire) -> str:
    """The allocation's own id, or one derived from what identifies an assignment."""
    given = _text(record.get("allocation_id"))
    if given:
        return given
    parts = [
        record.get(f)
        for f in ("cluster", "node", "pod_uid", "namespace", "pod", "container", "resource_name")
    ]
    parts += [record.get("device_id"), record.get("uuid"), record.get("started_at")]
    digest = hashlib.sha256(json_bytes([_clean_json(p) for p in parts])).hexdigest()
    return digest[:32]


def allocation_row(record: Wire) -> tuple[Any, ...]:
    row: dict[str, Any] = {
        "allocation_id": allocation_id(record),
        "record_id": _record_id(record),
        "started_at": parse_time(record.get("started_at")),
        "ended_at": parse_time(record.get("ended_at")),
        "attributes": to_json(record),
    }
    for column, fields in _ALLOCATION_FIELDS.items():
        value = next((record[f] for f in fields if record.get(f) is not None), None)
        row[column] = _text(value)
    for column in ("cluster", "node", "machine", "gpu"):
        if row[column] is None:
            row[column] = ""
    return tuple(row[c] for c in ALLOCATION_COLUMNS)


def event_row(record: Wire) -> tuple[Any, ...]:
    observed = next(
        (t for t in (parse_time(record.get(f)) for f in _TIME_FIELDS) if t is not None), None
    )
    return (
        _record_id(record),
        _text(record.get("kind"), 64) or "unknown",
        _text(record.get("cluster")) or "",
        _text(record.get("node")) or "",
        _text(record.get("machine")) or "",
        observed,
        to_json(record),
    )


@dataclass(slots=True)
class Rows:
    readings: list[tuple[Any, ...]] = field(default_factory=list)
    allocations: list[tuple[Any, ...]] = field(default_factory=list)
    events: list[tuple[Any, ...]] = field(default_factory=list)


def split(batch: Sequence[AnyRecord]) -> Rows:
    """Each record's row, by table (the wire form is what the rows hold). An allocation's
    usage records are rows of the events table (one per record id; docs/accounting.md)."""
    rows = Rows()
    for record in map(to_wire, batch):
        kind = record.get("kind")
        if kind == "reading":
            row = reading_row(record)
            if row is not None:
                rows.readings.append(row)
                continue
        elif kind == "allocation" and record.get("event") != "usage":
            rows.allocations.append(allocation_row(record))
            continue
        rows.events.append(event_row(record))
    return rows
