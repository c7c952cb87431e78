"""Rows in PostgreSQL's COPY text format, and the spooled batch that carries them.

A backlog drains at COPY speed only if nothing is left to do per record when it drains, so the
exporter spools each batch already in the form `COPY … FROM STDIN` takes: one line per row,
tab-separated, `\\N` for NULL, backslash escapes. A stored batch is one header line giving each
table's row count and byte length, then the readings, allocations and events sections; batches
join by concatenating their sections.

Escaping is done once per row rather than per value: the row mapping guarantees no value holds
a NUL or a lone surrogate (PostgreSQL text cannot hold either), so NUL serves as the field
separator and a lone surrogate as the NULL marker while the row is escaped in one `translate`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gpuid_agent.runtime.errors import CorruptBatchError

MAGIC = b"#gpuid-pgcopy/1"
_SEP, _NULL = "\x00", "\ud800"
_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
_SPECIAL = re.compile("[\\\\\t\n\r]")


def _array(values: list[Any]) -> str:
    items = (str(v).replace("\\", "\\\\").replace('"', '\\"') for v in values)
    return "{" + ",".join(f'"{item}"' for item in items) + "}"


@functools.lru_cache(maxsize=256)  # a snapshot's rows share one read_time
def _time(value: datetime) -> str:
    return value.isoformat()


def _field(value: Any) -> str:
    kind = value.__class__
    if kind is int:
        return str(value)
    if value is None:
        return _NULL
    if kind is str:
        return value  # type: ignore[no-any-return]
    if isinstance(value, datetime):
        return _time(value)
    if isinstance(value, list):
        return _array(value) if value else "{}"
    return str(value)


def _escaped(value: Any) -> str:
    """One field on its own: the careful path for rows the fast one cannot take."""
    if value is None:
        return "\\N"
    text = _field(value).replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    return text.translate(_ESCAPES)


def line(row: Sequence[Any]) -> str:
    """One row as a COPY text line (without its newline)."""
    joined = _SEP.join([v if v.__class__ is str else _field(v) for v in row])
    if joined.count(_SEP) != len(row) - 1 or joined.count(_NULL) != row.count(None):
        return "\t".join(_escaped(v) for v in row)  # a value held a marker: escape one by one
    if _SPECIAL.search(joined) is not None:  # rare: most rows need no escape at all
        joined = joined.translate(_ESCAPES)
    return joined.replace(_SEP, "\t").replace(_NULL, "\\N")


def section(rows: Iterable[Sequence[Any]]) -> bytes:
    text = "".join(line(row) + "\n" for row in rows)
    return text.encode("utf-8")


@dataclass(frozen=True, slots=True)
class Payload:
    """One or more stored batches' rows, per table, in COPY text."""

    readings: bytes = b""
    allocations: bytes = b""
    events: bytes = b""
    counts: tuple[int, int, int] = (0, 0, 0)

    @property
    def records(self) -> int:
        return sum(self.counts)

    def encode(self) -> bytes:
        sizes = (len(self.readings), len(self.allocations), len(self.events))
        head = b" ".join([MAGIC, *(str(n).encode() for n in (*self.counts, *sizes))])
        return head + b"\n" + self.readings + self.allocations + self.events

    @classmethod
    def decode(cls, data: bytes) -> Payload:
        head, sep, body = data.partition(b"\n")
        parts = head.split(b" ")
        if not sep or parts[0] != MAGIC or len(parts) != 7:
            raise CorruptBatchError("not a COPY payload (header missing or malformed)")
        try:
            numbers = [int(p) for p in parts[1:]]
        except ValueError as exc:
            raise CorruptBatchError(f"malformed COPY payload header: {exc}") from exc
        counts, sizes = numbers[:3], numbers[3:]
        if min(numbers) < 0 or sum(sizes) != len(body):
            raise CorruptBatchError(
                f"COPY payload holds {len(body)} bytes, its header says {sizes}"
            )
        cut1, cut2 = sizes[0], sizes[0] + sizes[1]
        sections = (body[:cut1], body[cut1:cut2], body[cut2:])
        for count, part in zip(counts, sections, strict=True):
            if part.count(b"\n") != count or (part and not part.endswith(b"\n")):
                raise CorruptBatchError(
                    f"a COPY section does not hold the {count} rows it declares"
                )
        return cls(*sections, counts=(counts[0], counts[1], counts[2]))

    @classmethod
    def join_encoded(cls, encoded: Sequence[bytes]) -> Payload:
        """Many stored batches joined section by section: the delivery of a backlog, so
        per batch only its header is parsed; the joined sections are checked as a whole."""
        if len(encoded) == 1:
            return cls.decode(encoded[0])
        parts: tuple[list[memoryview], list[memoryview], list[memoryview]] = ([], [], [])
        counts = [0, 0, 0]
        for data in encoded:
            end = data.find(b"\n")
            head = data[:end].split(b" ") if end > 0 else ()
            if len(head) != 7 or head[0] != MAGIC:
                raise CorruptBatchError("not a COPY payload (header missing or malformed)")
            try:
                numbers = tuple(map(int, head[1:]))
            except ValueError as exc:
                raise CorruptBatchError(f"malformed COPY payload header: {exc}") from exc
            at = end + 1
            if min(numbers) < 0 or at + numbers[3] + numbers[4] + numbers[5] != len(data):
                raise CorruptBatchError("a COPY payload does not hold the bytes it declares")
            view = memoryview(data)
            for i in (0, 1, 2):
                size = numbers[3 + i]
                counts[i] += numbers[i]
                if not size:
                    continue
                if data[at + size - 1] != 0x0A:
                    raise CorruptBatchError("a COPY section does not end its last row")
                parts[i].append(view[at : at + size])
                at += size
        readings, allocations, events = (b"".join(p) for p in parts)
        for count, section in zip(counts, (readings, allocations, events), strict=True):
            if section.count(b"\n") != count:
                raise CorruptBatchError(f"COPY sections do not hold the {count} rows they declare")
        return cls(readings, allocations, events, (counts[0], counts[1], counts[2]))

    @classmethod
    def join(cls, payloads: Sequence[Payload]) -> Payload:
        if len(payloads) == 1:
            return payloads[0]
        return cls(
            b"".join(p.readings for p in payloads),
            b"".join(p.allocations for p in payloads),
            b"".join(p.events for p in payloads),
            (
                sum(p.counts[0] for p in payloads),
                sum(p.counts[1] for p in payloads),
                sum(p.counts[2] for p in payloads),
            ),
        )


def column_values(data: bytes, index: int) -> list[str]:
    """Column `index` of every line of a section, unescaped (ids hold no escapes in practice,
    but a line's text is decoded as COPY would)."""
    out: list[str] = []
    for raw in data.splitlines():
        value = raw.split(b"\t", index + 1)[index].decode("utf-8")
        if "\\" in value:
            value = _unescape(value)
        out.append(value)
    return out


_UNESCAPES = {"\\\\": "\\", "\\t": "\t", "\\n": "\n", "\\r": "\r"}


def _unescape(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        pair = value[i : i + 2]
        if pair in _UNESCAPES:
            out.append(_UNESCAPES[pair])
            i += 2
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def keep_lines(data: bytes, index: int, drop: set[str]) -> tuple[bytes, int]:
    """The section without lines whose column `index` is in `drop` nor repeats an earlier
    line's value (a record twice in one delivery is stored once); and the count kept."""
    seen = set(drop)
    kept: list[bytes] = []
    for raw, value in zip(data.splitlines(keepends=True), column_values(data, index), strict=True):
        if value in seen:
            continue
        seen.add(value)
        kept.append(raw)
    return b"".join(kept), len(kept)
