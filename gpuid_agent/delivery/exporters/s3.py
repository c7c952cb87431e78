"""One object per batch in S3 (or an S3-compatible store), with aiobotocore.

Keys are `<prefix>/<partition>/cluster=<c>/node=<n>/<timestamp>-<batch id>.<ext>`; the
timestamp and the batch id are the batch's own (kept in the spool), so a retried batch writes
the same key with the same bytes and two agents never write the same key. Readings go out as
CSV (gpuid's seven columns first, ours after) or NDJSON; in CSV mode records of other kinds
go to a sibling NDJSON object named after their kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import gzip
import io
import re
from collections.abc import Sequence
from datetime import UTC
from typing import TYPE_CHECKING, Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from gpuid_agent.delivery.exporters.base import (
    BatchMeta,
    Exporter,
    ExporterHealth,
    Record,
    gpuid_shape,
    json_bytes,
)
from gpuid_agent.records import columns
from gpuid_agent.runtime.errors import ExportError

if TYPE_CHECKING:
    from gpuid_agent.runtime.config import Settings

CSV_COLUMNS = columns.CSV_COLUMNS  # gpuid's seven first (`time` is its read_time), then ours
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_UNSAFE_SEGMENT = re.compile(r"[^A-Za-z0-9._=-]")  # prefix and partition keep Hive's `k=v`
# Content problems S3 will never accept; anything else (auth, bucket, throttling) may heal.
_REJECTING_CODES = frozenset({"EntityTooLarge", "InvalidDigest", "BadDigest", "InvalidArgument"})


def key_part(value: object, unsafe: re.Pattern[str] = _UNSAFE) -> str:
    """A value safe inside one key segment: no slashes, no dot-only segments, never empty."""
    text = unsafe.sub("_", str(value))[:128]
    if not text.strip("."):
        text = "_" + text
    return text


def partition(pattern: str, meta: BatchMeta) -> str:
    """The strftime partition of the batch's creation time (UTC), with empty segments removed."""
    try:
        rendered = meta.created.astimezone(UTC).strftime(pattern)
    except ValueError:
        rendered = meta.created.astimezone(UTC).strftime("year=%Y/month=%m/day=%d/hour=%H")
    segments = [key_part(s, _UNSAFE_SEGMENT) for s in rendered.split("/") if s.strip()]
    return "/".join(segments)


def stamp(meta: BatchMeta) -> str:
    created = meta.created.astimezone(UTC)
    return created.strftime("%Y%m%dT%H%M%S") + f".{created.microsecond // 1000:03d}Z"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def to_csv(records: Sequence[Record], header: bool) -> bytes:
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


def to_ndjson(records: Sequence[Record]) -> bytes:
    return b"".join(json_bytes(gpuid_shape(r)) + b"\n" for r in records)


class S3Exporter(Exporter):
    name = "s3"

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "gpuid",
        region: str = "",
        partition_pattern: str = "year=%Y/month=%m/day=%d/hour=%H",
        endpoint_url: str = "",
        path_style: bool = False,
        fmt: str = "csv",
        csv_header: bool = True,
        gzip_objects: bool = False,
        timeout: float = 30.0,
    ) -> None:
        self.bucket = bucket
        self.prefix = "/".join(key_part(s, _UNSAFE_SEGMENT) for s in prefix.split("/") if s.strip())
        self.region = region
        self.partition_pattern = partition_pattern
        self.endpoint_url = endpoint_url
        self.path_style = path_style
        self.fmt = fmt
        self.csv_header = csv_header
        self.gzip_objects = gzip_objects
        self.timeout = timeout
        self._stack: contextlib.AsyncExitStack | None = None
        self._s3: Any = None
        self._lock = asyncio.Lock()

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Exporter:
        return cls(
            settings.s3_bucket,
            prefix=settings.s3_prefix,
            region=settings.s3_region,
            partition_pattern=settings.s3_partition_pattern,
            endpoint_url=settings.s3_endpoint_url,
            path_style=settings.s3_path_style,
            fmt=settings.s3_format,
            csv_header=settings.s3_csv_header,
            gzip_objects=settings.s3_gzip,
            timeout=settings.timeout,
        )

    async def _client(self) -> Any:
        async with self._lock:
            if self._s3 is None:
                config = AioConfig(
                    s3={"addressing_style": "path" if self.path_style else "auto"},
                    retries={"total_max_attempts": 1},  # the pipeline retries, with backoff
                    connect_timeout=self.timeout,
                    read_timeout=self.timeout,
                )
                stack = contextlib.AsyncExitStack()
                self._s3 = await stack.enter_async_context(
                    get_session().create_client(
                        "s3",
                        region_name=self.region or None,
                        endpoint_url=self.endpoint_url or None,
                        config=config,
                    )
                )
                self._stack = stack
            return self._s3

    def objects(
        self, batch: Sequence[Record], meta: BatchMeta
    ) -> list[tuple[str, bytes, dict[str, str]]]:
        """(key, body, metadata) of every object this batch becomes."""
        groups: dict[tuple[str, str, str], list[Record]] = {}
        for record in batch:
            kind = str(record.get("kind", "reading"))
            part = "reading" if self.fmt == "ndjson" or kind == "reading" else kind
            group = (str(record.get("cluster", "")), str(record.get("node", "")), part)
            groups.setdefault(group, []).append(record)
        base = f"{self.prefix}/" if self.prefix else ""
        base += partition(self.partition_pattern, meta)
        out: list[tuple[str, bytes, dict[str, str]]] = []
        for (cluster, node, part), records in groups.items():
            if part == "reading" and self.fmt == "csv":
                ext, body = "csv", to_csv(records, self.csv_header)
                fmt = "csv"
            else:
                ext, body, fmt = "ndjson", to_ndjson(records), "ndjson"
            suffix = "" if part == "reading" else f".{key_part(part)}"
            if self.gzip_objects:
                body, ext = gzip.compress(body, 6), f"{ext}.gz"
            key = (
                f"{base}/cluster={key_part(cluster)}/node={key_part(node)}/"
                f"{stamp(meta)}-{meta.batch_id}{suffix}.{ext}"
            )
            versions = {key_part(r.get("schema_version", "")) for r in records}
            metadata = {
                "source": "gpuid-agent",
                "record_count": str(len(records)),
                "format": fmt,
                "schema_version": ",".join(sorted(versions)),
                "batch_id": meta.batch_id,
                "kind": key_part(part),
            }
            if fmt == "csv":
                metadata["columns"] = ",".join(CSV_COLUMNS)
                metadata["header"] = "true" if self.csv_header else "false"
            out.append((key, body, metadata))
        return out

    async def export(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> None:
        meta = meta or BatchMeta.new()
        try:
            s3 = await self._client()
            for key, body, metadata in self.objects(batch, meta):
                content_type = "text/csv" if metadata["format"] == "csv" else "application/x-ndjson"
                await s3.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=body,
                    ContentType="application/gzip" if self.gzip_objects else content_type,
                    Metadata=metadata,
                )
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", "unknown"))
            raise ExportError(
                f"S3 {code}: {error.get('Message', '')}",
                error_type=f"s3_{key_part(code)[:40]}",
                retryable=code not in _REJECTING_CODES,
            ) from exc
        except (BotoCoreError, OSError) as exc:
            kind = "timeout" if "timeout" in type(exc).__name__.lower() else "connection"
            raise ExportError(f"S3 unreachable: {exc}", error_type=kind) from exc

    async def health(self) -> ExporterHealth:
        try:
            s3 = await self._client()
            await s3.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "unknown")
            return ExporterHealth(ok=False, reason=f"bucket {self.bucket}: {code}")
        except (BotoCoreError, OSError) as exc:
            return ExporterHealth(ok=False, reason=f"S3 unreachable: {exc}")
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
        self._stack = None
        self._s3 = None
