"""The S3 exporter's objects as a source of records, read through DuckDB.

The objects a question can need are listed (one key prefix per record kind) and pruned by
their key: a node's question reads only that node's `node=` folders, and nothing partitioned
before the day ahead of its range (a batch's partition is when it was formed, never before
its records). They are fetched in parallel into a temporary directory, and DuckDB reads them
as they are: readings as CSV (with or without the header line) or NDJSON, the other kinds as
NDJSON, gzip or not. DuckDB selects (and for usage, sums) what the question asks; the rows
become facts as a directory's records do. DuckDB is an optional extra:
`pip install 'gpuid-agent[history-s3]'`.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from gpuid_agent.history.facts import (
    ALLOCATION_TEXT,
    AllocationRecords,
    Holding,
    Mark,
    Sighting,
    UsageAmount,
    mark,
    sighting,
)
from gpuid_agent.history.source import Where
from gpuid_agent.records.columns import CSV_COLUMNS
from gpuid_agent.runtime.errors import RecordsUnreachableError

if TYPE_CHECKING:
    from gpuid_agent.runtime.config import Settings

FETCHERS = 16
_LONG_VALUE = 240  # a partition value the exporter may have cut in the key
_CSV_HEADER = ",".join(CSV_COLUMNS[:3]).encode()
_TEXT = "VARCHAR"
# each record once: a re-send has the same record_id; a row without one is its own
_ONCE = "coalesce(record_id, uuid()::VARCHAR)"
_JSON_COLUMNS: dict[str, dict[str, str]] = {
    "reading": {
        c: _TEXT for c in (*CSV_COLUMNS, "read_time") if c not in ("time", "index", "module_id")
    },
    "allocation": {
        **{
            c: _TEXT
            for c in (
                *ALLOCATION_TEXT,
                "record_id",
                "event",
                "gpu",
                "serial",
                "started_at",
                "ended_at",
                "usage_start",
                "allocation_id",
            )
        },
        "gpu_seconds": "DOUBLE",
        "energy_joules": "DOUBLE",
    },
    "health": {
        c: _TEXT
        for c in (
            "kind",
            "cluster",
            "node",
            "chassis",
            "gpu",
            "uuid",
            "check",
            "state",
            "previous_state",
            "action",
            "reason",
            "read_time",
            "record_id",
        )
    },
    "hardware": {
        c: _TEXT
        for c in (
            "kind",
            "event",
            "cluster",
            "node",
            "chassis",
            "gpu",
            "uuid",
            "pci_bus_id",
            "old_serial",
            "new_serial",
            "read_time",
            "record_id",
        )
    },
}


def _granularity(pattern: str) -> timedelta | None:
    """How long one partition of the pattern lasts (None: it cannot prune)."""
    for code, length in (("%H", timedelta(hours=1)), ("%d", timedelta(days=1))):
        if code in pattern:
            return length
    return timedelta(days=31) if "%m" in pattern else None


class S3Source:
    name = "S3"

    def __init__(self, settings: Settings) -> None:
        try:
            import duckdb
        except ImportError:
            raise RecordsUnreachableError(
                "reading S3 needs DuckDB: pip install 'gpuid-agent[history-s3]'"
            ) from None
        self._duckdb = duckdb
        self.bucket = settings.s3_bucket
        self.prefix = settings.s3_prefix.strip("/")
        self.pattern = settings.s3_partition_pattern
        self._client_args: dict[str, Any] = {
            "region_name": settings.s3_region or None,
            "endpoint_url": settings.s3_endpoint_url or None,
            "path_style": settings.s3_path_style,
        }
        self._client: Any = None
        self._dir = Path(tempfile.mkdtemp(prefix="gpuid-history-"))
        self._fetched: dict[str, Path] = {}
        self._listed: dict[str, list[str]] = {}
        self.db = duckdb.connect()
        self.db.execute("SET TimeZone = 'UTC'")

    # ---- listing and fetching ------------------------------------------------------------

    def _s3(self) -> Any:
        if self._client is None:
            import botocore.session
            from botocore.config import Config

            args = dict(self._client_args)
            style = "path" if args.pop("path_style") else "auto"
            self._client = botocore.session.get_session().create_client(
                "s3",
                config=Config(
                    s3={"addressing_style": style},
                    connect_timeout=10,
                    read_timeout=60,
                    retries={"max_attempts": 3},
                    max_pool_connections=FETCHERS,
                ),
                **args,
            )
        return self._client

    def _failed(self, exc: Exception) -> RecordsUnreachableError:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        where = f"s3://{self.bucket}/{self.prefix}"
        if code == "NoSuchBucket":
            return RecordsUnreachableError(f"no bucket {self.bucket!r}: check S3_BUCKET")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return RecordsUnreachableError(
                f"{where}: {code}: check the AWS credentials (AWS_ACCESS_KEY_ID, the role) "
                "and S3_REGION"
            )
        if code:
            return RecordsUnreachableError(f"{where}: {code}: check S3_BUCKET and S3_PREFIX")
        why = " ".join(str(exc).split()) or type(exc).__name__
        return RecordsUnreachableError(
            f"cannot reach S3 for {where} ({why}): check S3_ENDPOINT_URL and S3_REGION"
        )

    def _keys(self, kind: str) -> Iterator[str]:
        from botocore.exceptions import BotoCoreError, ClientError

        root = f"{self.prefix}/{kind}/" if self.prefix else f"{kind}/"
        try:
            pages = (
                self._s3()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=self.bucket, Prefix=root)
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    yield item["Key"]
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(exc) from None

    def _wanted(self, key: str, kind: str, since: datetime | None, node: str | None) -> bool:
        parts = key.split("/")
        if node is not None:
            value = next((p[5:] for p in parts if p.startswith("node=")), None)
            if value is not None and unquote(value) != node and len(value) < _LONG_VALUE:
                return False
        step = _granularity(self.pattern)
        if since is None or step is None:
            return True
        root = f"{self.prefix}/{kind}/" if self.prefix else f"{kind}/"
        partition = key[len(root) :].split("/cluster=", 1)[0]
        try:
            formed = datetime.strptime(partition, self.pattern).replace(tzinfo=UTC)
        except ValueError:
            return True
        return formed + step > since - timedelta(days=1)

    def _fetch(
        self, kind: str, since: datetime | None = None, node: str | None = None
    ) -> list[Path]:
        from botocore.exceptions import BotoCoreError, ClientError

        if kind not in self._listed:
            self._listed[kind] = list(self._keys(kind))
        keys = [k for k in self._listed[kind] if self._wanted(k, kind, since, node)]
        missing = [k for k in keys if k not in self._fetched]

        def get(key: str) -> None:
            target = self._dir / key
            target.parent.mkdir(parents=True, exist_ok=True)
            body = self._s3().get_object(Bucket=self.bucket, Key=key)["Body"]
            with open(target, "wb") as out:
                shutil.copyfileobj(body, out)
            self._fetched[key] = target

        try:
            with ThreadPoolExecutor(FETCHERS) as pool:
                list(pool.map(get, missing))
        except (BotoCoreError, ClientError) as exc:
            raise self._failed(exc) from None
        except OSError as exc:
            raise RecordsUnreachableError(f"cannot keep S3 objects in {self._dir}: {exc}") from exc
        return [self._fetched[k] for k in keys]

    # ---- DuckDB --------------------------------------------------------------------------

    def _relation(self, kind: str, files: list[Path]) -> tuple[str, list[Any]] | None:
        """A FROM clause reading `files` and its parameters (None: there are none)."""
        ndjson = [str(f) for f in files if ".ndjson" in f.name]
        csv = [f for f in files if ".csv" in f.name]
        parts: list[str] = []
        params: list[Any] = []
        if ndjson:
            parts.append(
                "SELECT * FROM read_json(?, format = 'newline_delimited', "
                f"columns = {_JSON_COLUMNS[kind]!r}, ignore_errors = true)"
            )
            params.append(ndjson)
        csv_columns = {c: _TEXT for c in CSV_COLUMNS}
        for header in (False, True):
            group = [str(f) for f in csv if _has_header(f) == header]
            if group:
                parts.append(
                    'SELECT * EXCLUDE ("time"), "time" AS read_time FROM read_csv(?, '
                    f"header = {str(header).lower()}, delim = ',', quote = '\"', "
                    f"escape = '\"', null_padding = true, ignore_errors = true, "
                    f"columns = {csv_columns!r})"
                )
                params.append(group)
        if not parts:
            return None
        return "(" + " UNION ALL BY NAME ".join(parts) + ")", params

    def _rows(self, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        try:
            cursor = self.db.execute(sql, params)
        except self._duckdb.Error as exc:
            raise RecordsUnreachableError(f"DuckDB could not read the S3 objects: {exc}") from exc
        names = [d[0] for d in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def _select(
        self,
        kind: str,
        where: Where,
        condition: str,
        params: list[Any],
        since: datetime | None = None,
    ) -> list[dict[str, Any]]:
        """The records of `kind` that meet `condition` (`{r}` in it: the same records), each
        once; objects partitioned a day before `since` are not read."""
        found = self._relation(kind, self._fetch(kind, since, where.node))
        if found is None:
            return []
        relation, files = found
        inner = condition.count("{r}")
        condition = condition.replace("{r}", relation)
        if where.cluster is not None:
            condition += " AND cluster = ?"
        sql = f"SELECT DISTINCT ON ({_ONCE}) * FROM {relation} WHERE {condition}"
        cluster = [where.cluster] if where.cluster is not None else []
        return self._rows(sql, [*files, *(files * inner), *params, *cluster])

    # ---- the Source protocol -------------------------------------------------------------

    def sightings(self, where: Where) -> list[Sighting]:
        if where.serial is not None:
            rows = self._select("reading", where, "gpu = ?", [where.serial])
        else:
            rows = self._select("reading", where, "node = ?", [where.node], where.since)
        found = (sighting(r) for r in rows)
        return sorted(
            (
                s
                for s in found
                if s is not None
                and (where.serial is not None or _within(s.time, where.since, where.until))
            ),
            key=lambda s: s.time,
        )

    def holdings(self, where: Where) -> list[Holding]:
        """Every record of each allocation that matches (its start may be in any partition)."""
        if where.pod is not None:
            matches, params = "namespace = ? AND pod = ?", [where.namespace, where.pod]
        elif where.serial is not None:
            matches, params = "(gpu = ? OR serial = ?)", [where.serial, where.serial]
        else:
            matches, params = "node = ?", [where.node]
        condition = f"allocation_id IN (SELECT allocation_id FROM {{r}} WHERE {matches})"
        gathered: dict[str, AllocationRecords] = {}
        for row in self._select("allocation", where, condition, params):
            gathered.setdefault(str(row["allocation_id"]), AllocationRecords()).take(row)
        held = [g.holding(a) for a, g in gathered.items()]
        if where.node is not None:
            held = [h for h in held if _overlaps(h, where.since, where.until)]
        return sorted(held, key=lambda h: (h.started_at is None, h.started_at, h.allocation_id))

    def marks(self, where: Where) -> list[Mark]:
        found: list[Mark] = []
        for kind in ("health", "hardware"):
            if where.serial is not None:
                extra = " OR old_serial = ?" if kind == "hardware" else ""
                rows = self._select(
                    kind, where, f"(gpu = ?{extra})", [where.serial] * (1 + bool(extra))
                )
            else:
                rows = self._select(kind, where, "node = ?", [where.node], where.since)
            for row in rows:
                m = mark({**row, "kind": kind})
                if m is not None and (
                    where.serial is not None or _within(m.time, where.since, where.until)
                ):
                    found.append(m)
        return sorted(found, key=lambda m: m.time)

    def usage(self, since: datetime, until: datetime, cluster: str | None) -> list[UsageAmount]:
        found = self._relation("allocation", self._fetch("allocation", since))
        if found is None:
            return []
        relation, files = found
        params: list[Any] = [*files, since, until]
        sql = f"""
            SELECT coalesce(namespace, ''), coalesce(workload_kind, ''),
                   coalesce(workload_name, ''), sum(coalesce(gpu_seconds, 0)),
                   sum(coalesce(energy_joules, 0))
            FROM (SELECT DISTINCT ON ({_ONCE}) * FROM {relation} WHERE event = 'usage')
            WHERE TRY_CAST(usage_start AS TIMESTAMPTZ) >= ?
              AND TRY_CAST(usage_start AS TIMESTAMPTZ) < ?"""
        if cluster is not None:
            sql += " AND cluster = ?"
            params.append(cluster)
        rows = self._rows(sql + " GROUP BY 1, 2, 3 ORDER BY 1, 2, 3", params)
        return [
            UsageAmount(str(ns), str(kind), str(name), float(seconds), float(joules))
            for ns, kind, name, seconds, joules in (tuple(r.values()) for r in rows)
        ]

    def close(self) -> None:
        self.db.close()
        if self._client is not None:
            self._client.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _has_header(path: Path) -> bool:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            return bytes(fh.readline()).startswith(_CSV_HEADER)
    except (OSError, EOFError):
        return False


def _within(moment: datetime, since: datetime | None, until: datetime | None) -> bool:
    return (since is None or moment >= since) and (until is None or moment <= until)


def _overlaps(h: Holding, since: datetime | None, until: datetime | None) -> bool:
    if h.started_at is not None and until is not None and h.started_at > until:
        return False
    return not (h.ended_at is not None and since is not None and h.ended_at < since)
