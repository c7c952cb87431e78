"""Where each record lands in the bucket, and in which bytes.

One key prefix per record kind, so one table definition (DuckDB glob, Athena/Trino table)
reads one format:

    <prefix>/<kind>/<partition>/cluster=<cluster>/node=<node>/<stamp>-<batch id>.<ext>

Readings are CSV in gpuid's column order (or NDJSON with `S3_FORMAT=ndjson`); every other
kind is NDJSON. Partition values are percent-encoded the way Hive escapes them, so engines
that decode Hive partitions (DuckDB does) see exactly the record's cluster and node.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.records import columns
from gpuid_agent.records.serialize import Wire, gpuid_shape, json_bytes, to_wire
from gpuid_agent.records.types import AnyRecord

CSV_COLUMNS = columns.CSV_COLUMNS  # gpuid's seven first (`time` is its read_time), then ours
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_UNSAFE_SEGMENT = re.compile(r"[^A-Za-z0-9._=-]")  # prefix and partition keep Hive's `k=v`
# Keys stay far below S3's 1,024 bytes; a longer value is cut (and then no longer decodes
# to the record's own value, which the record still carries in full).
_MAX_VALUE = 250
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_HIVE_NULL = b"__HIVE_DEFAULT_PARTITION__"  # Hive's name for NULL; engines read it so


def key_part(value: object, unsafe: re.Pattern[str] = _UNSAFE) -> str:
    """A value safe inside one key segment: no slashes, no dot-only segments, never empty."""
    text = unsafe.sub("_", str(value))[:128]
    if not text.strip("."):
        text = "_" + text
    return text


def hive_value(value: object) -> str:
    """A Hive partition value: bytes outside `A-Z a-z 0-9 . _ -` as `%XX` (UTF-8), a value
    of dots only fully escaped (`.` and `..` are not keys' segments), and so is the first
    byte of Hive's NULL marker; empty stays empty."""
    raw = str(value).encode("utf-8", "replace")
    if raw and not raw.strip(b"."):
        return "".join("%2E" for _ in raw)[: _MAX_VALUE - _MAX_VALUE % 3]
    if raw == _HIVE_NULL:
        return "%5F" + raw[1:].decode()
    out: list[str] = []
    size = 0
    for byte in raw:
        piece = chr(byte) if byte in _SAFE_BYTES else f"%{byte:02X}"
        if size + len(piece) > _MAX_VALUE:
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)


def partition(pattern: str, meta: BatchMeta) -> str:
    """The strftime partition of the batch's creation time (UTC), with empty segments removed."""
    try:
        rendered = meta.created.astimezone(UTC).strftime(pattern)
    except ValueError:
        rendered = meta.created.astimezone(UTC).strftime("year=%Y/month=%m/day=%d/hour=%H")
    segments = [key_part(s, _UNSAFE_SEGMENT) for s in rendered.split("/") if s.strip()]
    return "/".join(segments)


def clean_prefix(prefix: str) -> str:
    return "/".join(key_part(s, _UNSAFE_SEGMENT) for s in prefix.split("/") if s.strip())


def stamp(meta: BatchMeta) -> str:
    created = meta.created.astimezone(UTC)
    return created.strftime("%Y%m%dT%H%M%S") + f".{created.microsecond // 1000:03d}Z"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def to_csv(records: Sequence[Wire], header: bool) -> bytes:
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, lineterminator="\n")
    # With "\n" line ends the csv module does not quote a lone "\r"; such rows quote all.
    quoting = csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_ALL)
    if header:
        writer.writerow(CSV_COLUMNS)
    for record in records:
        shaped = gpuid_shape(record)
        cells = [_cell(shaped.get(c)) for c in CSV_COLUMNS]
        (quoting if any("\r" in c for c in cells) else writer).writerow(cells)
    return buffer.getvalue().encode("utf-8", "replace")


def to_ndjson(records: Sequence[Wire]) -> bytes:
    return b"".join(json_bytes(gpuid_shape(r)) + b"\n" for r in records)


@dataclass(frozen=True, slots=True)
class S3Object:
    key: str
    body: bytes
    metadata: dict[str, str]
    content_type: str


@dataclass(frozen=True, slots=True)
class Layout:
    """The key and body rules of one exporter's settings."""

    prefix: str = "gpuid"
    partition_pattern: str = "year=%Y/month=%m/day=%d/hour=%H"
    fmt: str = "csv"
    csv_header: bool = False
    gzip_objects: bool = False

    def kind_root(self, kind: str) -> str:
        """The key prefix of one record kind: the table location of that kind."""
        base = clean_prefix(self.prefix)
        return f"{base}/{key_part(kind)}" if base else key_part(kind)

    def objects(self, batch: Sequence[AnyRecord], meta: BatchMeta) -> list[S3Object]:
        """Every object this batch becomes: one per (kind, cluster, node)."""
        groups: dict[tuple[str, str, str], list[Wire]] = {}
        for record in map(to_wire, batch):
            group = (
                str(record.get("kind") or "reading"),
                str(record.get("cluster", "")),
                str(record.get("node", "")),
            )
            groups.setdefault(group, []).append(record)
        when = partition(self.partition_pattern, meta)
        return [self._object(group, records, meta, when) for group, records in groups.items()]

    def _object(
        self, group: tuple[str, str, str], records: list[Wire], meta: BatchMeta, when: str
    ) -> S3Object:
        kind, cluster, node = group
        if kind == "reading" and self.fmt == "csv":
            fmt, ext, body = "csv", "csv", to_csv(records, self.csv_header)
            content_type = "text/csv"
        else:
            fmt, ext, body = "ndjson", "ndjson", to_ndjson(records)
            content_type = "application/x-ndjson"
        if self.gzip_objects:
            body, ext, content_type = gzip.compress(body, 6), f"{ext}.gz", "application/gzip"
        root = self.kind_root(kind)
        where = f"{when}/" if when else ""
        key = (
            f"{root}/{where}cluster={hive_value(cluster)}/node={hive_value(node)}/"
            f"{stamp(meta)}-{meta.batch_id}.{ext}"
        )
        versions = {key_part(r.get("schema_version", "")) for r in records}
        metadata = {
            "source": "gpuid-agent",
            "record_count": str(len(records)),
            "format": fmt,
            "schema_version": ",".join(sorted(versions)),
            "batch_id": meta.batch_id,
            "kind": key_part(kind),
        }
        if fmt == "csv":
            metadata["columns"] = ",".join(CSV_COLUMNS)
            metadata["header"] = "true" if self.csv_header else "false"
        return S3Object(key, body, metadata, content_type)
