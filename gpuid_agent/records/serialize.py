"""The one serializer: a typed record to its wire dict and back, and the JSON bytes of both.

`to_wire` gives the dict every sink receives (same names, values, order and ids as ever);
`from_wire` reads one back (from a spool file or a state file) strictly: a dict `to_wire` could
not have written raises `WireError` rather than becoming a record that says something else,
so `to_wire(from_wire(w)) == w`, key order included, for every dict it accepts.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any, Literal

import orjson

from gpuid_agent.records.types import (
    AllocationRecord,
    AnyRecord,
    HardwareRecord,
    HealthRecord,
    ReadingRecord,
)
from gpuid_agent.runtime.errors import WireError

__all__ = [
    "Wire",
    "WireError",
    "allocation_from_wire",
    "from_json_lines",
    "from_wire",
    "gpuid_shape",
    "json_bytes",
    "json_lines",
    "rfc3339",
    "to_wire",
]

Wire = dict[str, Any]
"""The wire form of one record: what exporters serialize and the spool keeps."""

_CLAIM_FIELDS = ("claim_namespace", "claim_name", "claim_source")
_USAGE_FIELDS = ("gpu_seconds", "energy_joules", "usage_start")  # written only when known
_RECORD_TYPES: tuple[type[AnyRecord], ...] = (
    ReadingRecord,
    AllocationRecord,
    HealthRecord,
    HardwareRecord,
)
# One C-level getter per type: records are built per GPU per collection, so this path is hot.
_GETTERS = {cls: (cls.__slots__, attrgetter(*cls.__slots__)) for cls in _RECORD_TYPES}


def rfc3339(moment: datetime) -> str:
    """UTC RFC 3339 with millisecond precision and a Z suffix."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def to_wire(record: AnyRecord) -> Wire:
    """The dict exporters and the spool receive; same names, values and ids as ever."""
    names, get = _GETTERS[type(record)]
    wire: Wire = dict(zip(names, get(record), strict=True))
    if isinstance(record, HardwareRecord):
        return wire  # its id is carried: it names the change, not the moment it was seen
    if isinstance(record, AllocationRecord):
        if record.end_observed is not False:
            del wire["last_seen_at"]  # only an unseen end carries it
        if record.claim_name is None:
            for name in _CLAIM_FIELDS:  # not a DRA allocation: the wire is as it always was
                del wire[name]
        for name in _USAGE_FIELDS:
            if wire[name] is None:
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


def _content_id(wire: Mapping[str, Any]) -> str:
    try:
        canonical = orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # what orjson refuses (a lone surrogate, an int past 64 bits) still hashes
        canonical = json.dumps(
            wire, sort_keys=True, ensure_ascii=True, separators=(",", ":"), default=str
        ).encode()
    return hashlib.sha256(canonical).hexdigest()[:32]


def json_bytes(value: Any) -> bytes:
    """JSON of wire records; strings orjson refuses (lone surrogates) go through ASCII escapes."""
    try:
        return orjson.dumps(value, default=str)
    except TypeError:
        return json.dumps(value, default=str, ensure_ascii=True, separators=(",", ":")).encode()


def json_lines(records: Iterable[AnyRecord]) -> bytes:
    """Records as JSON lines, one wire dict a line: stdout's output and the spool's files."""
    return b"".join(json_bytes(to_wire(r)) + b"\n" for r in records)


def from_json_lines(data: bytes) -> list[AnyRecord]:
    """The records of `json_lines` output (of this release or an earlier one)."""
    # Fast path: JSON text never holds a raw newline, so the lines joined by commas are one
    # JSON array, parsed in one call.
    body = data.strip()
    try:
        wires = orjson.loads(b"[" + body.replace(b"\n", b",") + b"]") if body else []
    except orjson.JSONDecodeError:
        wires = [_line(line) for line in data.splitlines() if line.strip()]
    return [from_wire(wire) for wire in wires]


def _line(line: bytes) -> Any:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        try:  # lines written through the ASCII-escape fallback
            return json.loads(line)
        except ValueError as exc:
            raise WireError(f"unreadable line: {exc}") from exc


def gpuid_shape(wire: Wire) -> Wire:
    """A reading as gpuid's receivers expect it: its `time` field beside our `read_time`."""
    if wire.get("kind") == "reading" and "time" not in wire and "read_time" in wire:
        return {**wire, "time": wire["read_time"]}
    return wire


# ---- back from the wire ------------------------------------------------------------------------

Check = Callable[[Any], bool]
_SCALARS: dict[Any, type] = {
    str: str,
    int: int,
    float: float,
    bool: bool,
    None: type(None),
    type(None): type(None),
}


def _scalar_types(annotation: Any) -> frozenset[type] | None:
    """The exact types a field of plain scalars takes (a bool is no int here), or None."""
    parts = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (types.UnionType, typing.Union)
        else (annotation,)
    )
    if all(part in _SCALARS for part in parts):
        return frozenset(_SCALARS[part] for part in parts)
    return None


def _check(annotation: Any) -> Check:
    """A test of one wire value against a field's annotation (tuples travel as lists)."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        return lambda v: type(v) is str and v in allowed
    item = typing.get_args(annotation)[0]
    if origin is tuple and typing.get_origin(item) is dict:
        return lambda v: (
            type(v) is list
            and all(
                type(h) is dict and all(type(k) is str and type(x) is str for k, x in h.items())
                for h in v
            )
        )
    if origin is tuple and item is str:
        return lambda v: type(v) is list and all(type(x) is str for x in v)
    raise TypeError(f"no wire check for {annotation!r}")


class _Shape:
    """How one record type's fields are checked: most by exact type, a few by a test."""

    def __init__(self, cls: type[AnyRecord]) -> None:
        hints = typing.get_type_hints(cls)
        self.names = frozenset(f.name for f in fields(cls))
        self.scalars: list[tuple[str, frozenset[type]]] = []
        self.others: list[tuple[str, Check]] = []
        for f in fields(cls):
            allowed = _scalar_types(hints[f.name])
            if allowed is None:
                self.others.append((f.name, _check(hints[f.name])))
            else:
                self.scalars.append((f.name, allowed))

    def wrong(self, wire: Mapping[str, Any]) -> list[str]:
        """The fields present in `wire` whose value its type cannot hold."""
        out = [n for n, allowed in self.scalars if n in wire and type(wire[n]) not in allowed]
        return out + [n for n, check in self.others if n in wire and not check(wire[n])]


_SHAPES = {cls: _Shape(cls) for cls in _RECORD_TYPES}
_BY_KIND: dict[str, type[AnyRecord]] = {
    "reading": ReadingRecord,
    "allocation": AllocationRecord,
    "health": HealthRecord,
    "hardware": HardwareRecord,
}
_NAMES = {cls: shape.names for cls, shape in _SHAPES.items()}
_READING_KEYS = _NAMES[ReadingRecord] | {"record_id"}
_HEALTH_KEYS = _NAMES[HealthRecord] - {"holders"} | {"record_id"}
_ALLOCATION_KEYS = _NAMES[AllocationRecord] - {"last_seen_at", *_CLAIM_FIELDS, *_USAGE_FIELDS}


def from_wire(wire: Mapping[str, Any]) -> AnyRecord:
    """The typed record `wire` is the wire form of; `WireError` says why it is none."""
    if type(wire) is not dict and not isinstance(wire, Mapping):
        raise WireError(f"a record is a JSON object, not {type(wire).__name__}")
    kind = wire.get("kind")
    cls = _BY_KIND.get(kind) if type(kind) is str else None
    if cls is None:
        raise WireError(f"unknown record kind {kind!r}")
    _expect_keys(cls, wire)
    wrong = _SHAPES[cls].wrong(wire)
    if wrong:
        raise WireError(f"{kind} record has a wrong type in {', '.join(sorted(wrong))}")
    values = dict(wire)
    if cls is ReadingRecord or cls is HealthRecord:
        given = values.pop("record_id")
        if given != _content_id(values):  # the id hashes the rest, as written
            raise WireError(f"{kind} record_id does not match the record's content")
    if cls is ReadingRecord:
        values["mig_devices"] = tuple(values["mig_devices"])
    elif cls is HealthRecord and "holders" in values:
        values["holders"] = tuple(dict(h) for h in values["holders"])
    return cls(**values)


def _expect_keys(cls: type[AnyRecord], wire: Mapping[str, Any]) -> None:
    """Raise unless `wire` has exactly the fields `to_wire` writes for a record like it (in
    any order: state files keep them sorted)."""
    keys = wire.keys()
    if cls is ReadingRecord:
        expected = _READING_KEYS
    elif cls is HealthRecord:
        expected = _HEALTH_KEYS | ({"holders"} if wire.get("holders") else set())
    elif cls is AllocationRecord:
        expected = _ALLOCATION_KEYS
        if wire.get("end_observed") is False:  # an unseen end: `to_wire` always writes it
            expected = expected | {"last_seen_at"}
        if wire.get("claim_name") is not None:
            expected = expected | set(_CLAIM_FIELDS)
        expected = expected | {n for n in _USAGE_FIELDS if wire.get(n) is not None}
    else:
        expected = _NAMES[cls]
    if keys != expected:
        missing = sorted(expected - keys)
        extra = sorted(keys - expected)
        what = [f"lacks {', '.join(missing)}"] if missing else []
        what += [f"has no field {', '.join(extra)}"] if extra else []
        raise WireError(f"{wire.get('kind')} record {' and '.join(what)}")


def allocation_from_wire(wire: Mapping[str, Any]) -> AllocationRecord:
    """An allocation record back from its wire dict (the trail's state file holds those)."""
    record = from_wire(wire)
    if not isinstance(record, AllocationRecord):
        raise WireError(f"not an allocation record: {type(record).__name__}")
    return record
