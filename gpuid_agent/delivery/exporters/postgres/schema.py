"""Table names, the schema migration and the statements that move staged rows into tables.

Identifiers are validated, never quoted: PostgreSQL folds unquoted names to lower case, as
gpuid's own CREATE TABLE did, so POSTGRES_TABLE names the same table for both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuid_agent.delivery.exporters.postgres import usage_rollup
from gpuid_agent.records import columns

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
# pg_advisory_lock key that serialises migrations of every agent ("gpuid" in ASCII).
MIGRATION_LOCK = 0x6770756964

STAGE_READINGS = "gpuid_stage_readings"
STAGE_ALLOCATIONS = "gpuid_stage_allocations"
STAGE_EVENTS = "gpuid_stage_events"


def _checked(name: str) -> str:
    if not IDENTIFIER.fullmatch(name):
        raise ValueError(f"{name!r} is not an SQL identifier (optionally schema-qualified)")
    return name


@dataclass(frozen=True, slots=True)
class Tables:
    readings: str
    allocations: str
    events: str

    @classmethod
    def named(cls, readings: str, allocations: str, events: str) -> Tables:
        """Bare allocation/event names go into the readings table's schema."""
        _checked(readings)
        schema = readings.split(".", maxsplit=1)[0] + "." if "." in readings else ""
        return cls(
            readings,
            _checked(allocations if "." in allocations else schema + allocations),
            _checked(events if "." in events else schema + events),
        )

    @property
    def schema(self) -> str | None:
        return self.readings.split(".")[0] if "." in self.readings else None


def _bare(table: str) -> str:
    return table.rsplit(".", maxsplit=1)[-1]


def _index(table: str, suffix: str) -> str:
    return f"idx_{_bare(table)}_{suffix}"[:63]


_NOT_IN_ORDER = ("record_id", "attributes")
# The allocations table: the registry's columns (record_id is staged only: it lands in
# start_record_id or end_record_id) and the table's own. A column added to the registry is
# added to existing tables by the migration, so it must be nullable or have a default.
ALLOCATION_TABLE: tuple[tuple[str, str], ...] = (
    *((c.name, c.declared) for c in columns.ALLOCATIONS if c.name not in _NOT_IN_ORDER),
    # accounting totals, filled by an allocation's end (docs/accounting.md); not staged: they
    # travel in the end record's `attributes`
    ("gpu_seconds", "DOUBLE PRECISION"),
    ("energy_joules", "DOUBLE PRECISION"),
    ("start_record_id", "VARCHAR(255)"),
    ("end_record_id", "VARCHAR(255)"),
    ("attributes", "JSONB"),
    ("created_at", "TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW()"),
    ("updated_at", "TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW()"),
)
EVENT_TABLE: tuple[tuple[str, str], ...] = (
    ("id", "BIGSERIAL PRIMARY KEY"),
    ("record_id", "VARCHAR(255) NOT NULL"),
    ("kind", "VARCHAR(64) NOT NULL"),
    ("cluster", "VARCHAR(255) NOT NULL DEFAULT ''"),
    ("node", "VARCHAR(255) NOT NULL DEFAULT ''"),
    ("machine", "VARCHAR(255) NOT NULL DEFAULT ''"),
    ("observed_at", "TIMESTAMP WITH TIME ZONE"),
    ("payload", "JSONB NOT NULL"),
    ("created_at", "TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW()"),
)


def _addable(declared: str) -> bool:
    """A column ADD COLUMN can give a table that has rows: nullable, or with a default."""
    upper = declared.upper()
    return "PRIMARY KEY" not in upper and ("NOT NULL" not in upper or "DEFAULT" in upper)


def _table(name: str, table: tuple[tuple[str, str], ...]) -> list[str]:
    """CREATE TABLE, then every column a table made by an older version (or by hand) may
    lack, added where it can be: a table missing one that cannot is named by its delivery."""
    body = ",\n".join(f"            {column} {declared}" for column, declared in table)
    return [
        f"CREATE TABLE IF NOT EXISTS {name} (\n{body}\n        )",
        *(
            f"ALTER TABLE {name} ADD COLUMN IF NOT EXISTS {column} {declared}"
            for column, declared in table
            if _addable(declared)
        ),
    ]


def expected_columns(tables: Tables) -> dict[str, frozenset[str]]:
    """Each table's columns, as the writer fills them."""
    readings = frozenset(c.name for c in columns.READINGS) | {"id", "created_at"}
    return {
        tables.readings: readings,
        tables.allocations: frozenset(name for name, _ in ALLOCATION_TABLE),
        tables.events: frozenset(name for name, _ in EVENT_TABLE),
    }


def migration(tables: Tables) -> list[str]:
    """Idempotent DDL; run in one transaction while holding MIGRATION_LOCK."""
    r, a, e = tables.readings, tables.allocations, tables.events
    statements: list[str] = []
    schemas = {t.split(".")[0] for t in (r, a, e) if "." in t}
    statements += [f"CREATE SCHEMA IF NOT EXISTS {s}" for s in sorted(schemas)]
    # gpuid's table as gpuid creates it, minus its UNIQUE over every column: a GB200
    # superchip's two dies share a serial, so that constraint would drop one of them.
    gpuid = "".join(f"            {c.name} {c.sql},\n" for c in columns.READINGS if c.gpuid)
    statements.append(
        f"""CREATE TABLE IF NOT EXISTS {r} (
            id BIGSERIAL PRIMARY KEY,
{gpuid}            created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW()
        )"""
    )
    # Ours, added to a gpuid table too (a migrated table keeps its rows, record_id NULL).
    extra = [c.ddl for c in columns.READINGS if not c.gpuid or c.default]
    statements += [f"ALTER TABLE {r} ADD COLUMN IF NOT EXISTS {c}" for c in extra]
    statements.append(
        f"CREATE UNIQUE INDEX IF NOT EXISTS {_index(r, 'record_id')} ON {r} (record_id)"
    )
    for column in ("cluster", "node", "read_time", "created_at", "gpu", "uuid"):
        statements.append(f"CREATE INDEX IF NOT EXISTS {_index(r, column)} ON {r} ({column})")
    statements += _table(a, ALLOCATION_TABLE)
    statements += [
        f"CREATE INDEX IF NOT EXISTS {_index(a, 'open')} ON {a} (namespace) WHERE ended_at IS NULL",
        f"CREATE INDEX IF NOT EXISTS {_index(a, 'gpu')} ON {a} (gpu)",
        f"CREATE INDEX IF NOT EXISTS {_index(a, 'uuid')} ON {a} (uuid)",
        f"CREATE INDEX IF NOT EXISTS {_index(a, 'started_at')} ON {a} (started_at)",
    ]
    statements += _table(e, EVENT_TABLE)
    statements += [
        f"CREATE UNIQUE INDEX IF NOT EXISTS {_index(e, 'record_id')} ON {e} (record_id)",
        f"CREATE INDEX IF NOT EXISTS {_index(e, 'kind_time')} ON {e} (kind, observed_at)",
        # (node) alone: what `_node_kind_time` (below) now serves; a database that has it
        # keeps it
    ]
    statements += usage_rollup.migration(e)
    return statements + [
        f"CREATE INDEX IF NOT EXISTS {name} ON {table} {how}"
        for name, (table, how) in history_indexes(tables).items()
    ]


def history_indexes(tables: Tables) -> dict[str, tuple[str, str]]:
    """The indexes `gpuid-agent history` reads through (docs/history.md), by name: the table
    and what each covers. Added to existing tables by the migration; a large table may have
    them built beforehand with CREATE INDEX CONCURRENTLY under the same names."""
    r, a, e = tables.readings, tables.allocations, tables.events
    rollup = usage_rollup.rollup_table(e)
    return {
        _index(r, "node_time"): (r, "(node, read_time)"),
        _index(a, "node_started"): (a, "(node, started_at)"),
        _index(a, "pod"): (a, "(namespace, pod)"),
        _index(e, "node_kind_time"): (e, "(node, kind, observed_at)"),
        _index(e, "gpu"): (e, "((payload->>'gpu')) WHERE kind IN ('health', 'hardware')"),
        _index(e, "old_serial"): (e, "((payload->>'old_serial')) WHERE kind = 'hardware'"),
        # whole days' totals read from the index alone, not from rows that carry hourly arrays
        _index(rollup, "totals"): (
            rollup,
            "(day, cluster) INCLUDE (namespace, workload_kind, workload_name, gpu_seconds, "
            "energy_joules)",
        ),
    }


# Staging tables: COPY lands here, then one INSERT … SELECT moves the rows. Created inside the
# delivery's transaction and dropped at its end: nothing outlives a transaction, so a pooler
# in transaction mode (PgBouncer) may hand each transaction another server connection.


def _staging(name: str, table: tuple[columns.Column, ...]) -> str:
    body = ", ".join(f"{c.name} {c.staged}" for c in table)
    return f"CREATE TEMP TABLE IF NOT EXISTS {name} ({body}) ON COMMIT DROP"


STAGING = (
    _staging(STAGE_READINGS, columns.READINGS),
    _staging(STAGE_ALLOCATIONS, columns.ALLOCATIONS),
    f"""CREATE TEMP TABLE IF NOT EXISTS {STAGE_EVENTS} (
        record_id TEXT, kind TEXT, cluster TEXT, node TEXT, machine TEXT,
        observed_at TIMESTAMPTZ, payload JSONB
    ) ON COMMIT DROP""",
)

_READING_TARGET = ", ".join(c.name for c in columns.READINGS)


def insert_readings(tables: Tables) -> str:
    # No conflict target: any unique index (ours on record_id, or gpuid's all-column UNIQUE
    # on a migrated table) makes a re-sent row a no-op instead of an error.
    return (
        f"INSERT INTO {tables.readings} ({_READING_TARGET}) "
        f"SELECT {_READING_TARGET} FROM {STAGE_READINGS} ON CONFLICT DO NOTHING"
    )


_DESCRIPTIVE = (
    "machine",
    "gpu",
    "uuid",
    "mig_uuid",
    "namespace",
    "pod",
    "pod_uid",
    "container",
    "resource_name",
    "device_id",
    "workload_kind",
    "workload_name",
    "claim_namespace",
    "claim_name",
    "claim_source",
)


_USED = ("gpu_seconds", "energy_joules")


def upsert_allocations(tables: Tables) -> str:
    """One row per allocation: its start and end (earliest of each, whatever order records
    arrive in); descriptive columns filled when first known. A re-sent record changes
    nothing, not even updated_at."""
    a = tables.allocations
    described = ", ".join(f"max({c})" for c in _DESCRIPTIVE)
    fill = ", ".join(f"{c} = COALESCE(t.{c}, EXCLUDED.{c})" for c in _DESCRIPTIVE + _USED)
    # an end's accounting totals travel in its record (the staged `attributes`)
    used = ", ".join(
        f"min((attributes->>'{c}')::double precision) FILTER (WHERE ended_at IS NOT NULL)"
        for c in _USED
    )
    return f"""
        INSERT INTO {a} AS t (allocation_id, cluster, node, {", ".join(_DESCRIPTIVE)},
            {", ".join(_USED)}, started_at, ended_at, start_record_id, end_record_id, attributes)
        SELECT allocation_id, max(cluster), max(node), {described}, {used},
            min(started_at), min(ended_at),
            min(record_id) FILTER (WHERE ended_at IS NULL),
            min(record_id) FILTER (WHERE ended_at IS NOT NULL),
            (array_agg(attributes ORDER BY ended_at DESC NULLS LAST, record_id))[1]
        FROM {STAGE_ALLOCATIONS} GROUP BY allocation_id
        ON CONFLICT (allocation_id) DO UPDATE SET
            started_at = LEAST(t.started_at, EXCLUDED.started_at),
            ended_at = LEAST(t.ended_at, EXCLUDED.ended_at),
            start_record_id = COALESCE(t.start_record_id, EXCLUDED.start_record_id),
            end_record_id = CASE
                WHEN t.ended_at IS NULL OR EXCLUDED.ended_at < t.ended_at
                THEN COALESCE(EXCLUDED.end_record_id, t.end_record_id)
                ELSE t.end_record_id END,
            attributes = CASE WHEN EXCLUDED.ended_at IS NOT NULL AND t.ended_at IS NULL
                THEN EXCLUDED.attributes ELSE t.attributes END,
            {fill},
            updated_at = NOW()
        WHERE t.started_at IS DISTINCT FROM LEAST(t.started_at, EXCLUDED.started_at)
           OR t.ended_at IS DISTINCT FROM LEAST(t.ended_at, EXCLUDED.ended_at)
           OR (t.start_record_id IS NULL AND EXCLUDED.start_record_id IS NOT NULL)
           OR (t.workload_name IS NULL AND EXCLUDED.workload_name IS NOT NULL)
           OR (t.gpu_seconds IS NULL AND EXCLUDED.gpu_seconds IS NOT NULL)
    """


def insert_events(tables: Tables) -> str:
    columns = "record_id, kind, cluster, node, machine, observed_at, payload"
    return (
        f"INSERT INTO {tables.events} ({columns}) SELECT {columns} FROM {STAGE_EVENTS} "
        "ON CONFLICT DO NOTHING"
    )


def stored_ids(tables: Tables) -> str:
    """Which of the record ids in $1 the readings table already holds."""
    return f"SELECT record_id FROM {tables.readings} WHERE record_id = ANY($1::text[])"


def refused_readings(tables: Tables) -> str:
    """How many staged readings the table still lacks after `insert_readings`: rows another
    unique constraint (not record_id's) refused."""
    return (
        f"SELECT count(DISTINCT s.record_id) FROM {STAGE_READINGS} s WHERE NOT EXISTS "
        f"(SELECT 1 FROM {tables.readings} r WHERE r.record_id = s.record_id)"
    )


def counted(insert: str) -> str:
    """An INSERT that answers how many rows it inserted (one value, not one row per row)."""
    return f"WITH inserted AS ({insert} RETURNING 1) SELECT count(*) FROM inserted"
