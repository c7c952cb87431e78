"""The usage rollup: GPU-seconds and energy per UTC day, node and workload, kept by PostgreSQL.

A fleet's usage records are one per open allocation per ACCOUNTING_INTERVAL: tens of millions a
month, too many to add up whenever someone asks for a month's GPU-hours. The events table's
trigger adds each usage record to one row of `<events>_usage` as it is stored: the day's totals
and a 24-entry array per hour (UTC) of the record's `usage_start`, so a question over any whole
hours reads one row per node, day and workload. Only rows the INSERT actually stored reach the
trigger (its transition table): a re-sent record, refused by the unique `record_id`, adds
nothing. Being the database's own, it holds for every agent writing, of whatever version.

The key has the node, so agents never wait on each other's rows. A value the record does not
carry as expected (a time that does not parse, an amount that is not a number) adds nothing
rather than failing the delivery.
"""

from __future__ import annotations

# Hours of a day: the hourly arrays' length.
HOURS = 24


def rollup_table(events: str) -> str:
    """`<events>_usage`, in the events table's schema."""
    return _in_schema(events, f"{_bare(events)}_usage"[:63])


def _in_schema(events: str, name: str) -> str:
    return f"{events.split('.', maxsplit=1)[0]}.{name}" if "." in events else name


def _bare(name: str) -> str:
    return name.rsplit(".", maxsplit=1)[-1]


def trigger_name(events: str) -> str:
    return f"{_bare(events)}_usage_rollup"[:63]


def _function(events: str, name: str) -> str:
    return _in_schema(events, f"{_bare(events)}_{name}"[:63])


_COLUMNS = (
    ("day", "DATE NOT NULL"),
    ("cluster", "TEXT NOT NULL"),
    ("node", "TEXT NOT NULL"),
    ("namespace", "TEXT NOT NULL"),
    ("workload_kind", "TEXT NOT NULL"),
    ("workload_name", "TEXT NOT NULL"),
    ("gpu_seconds", "DOUBLE PRECISION NOT NULL"),
    ("energy_joules", "DOUBLE PRECISION NOT NULL"),
    ("hourly_gpu_seconds", "DOUBLE PRECISION[] NOT NULL"),
    ("hourly_energy_joules", "DOUBLE PRECISION[] NOT NULL"),
    ("records", "BIGINT NOT NULL"),
)
KEY = ("day", "cluster", "node", "namespace", "workload_kind", "workload_name")


def added_from(source: str, events: str) -> str:
    """INSERT of the usage records of `source` (the events table or a trigger's transition
    table) into the rollup, added to the rows already there."""
    rollup = rollup_table(events)
    when = _function(events, "usage_time")
    number = _function(events, "usage_number")
    hourly = ", ".join(
        f"(SELECT array_agg(COALESCE({v}[array_position(hours, g)], 0) ORDER BY g) "
        f"FROM generate_series(0, {HOURS - 1}) AS g)"
        for v in ("gs", "ej")
    )
    merged = ", ".join(
        f"{c} = (SELECT array_agg(a + b ORDER BY i) FROM unnest(r.{c}, EXCLUDED.{c}) "
        "WITH ORDINALITY AS x(a, b, i))"
        for c in ("hourly_gpu_seconds", "hourly_energy_joules")
    )
    return f"""
        WITH used AS (
            SELECT {when}(payload->>'usage_start') AT TIME ZONE 'UTC' AS t,
                   cluster, node,
                   COALESCE(payload->>'namespace', '') AS namespace,
                   COALESCE(payload->>'workload_kind', '') AS workload_kind,
                   COALESCE(payload->>'workload_name', '') AS workload_name,
                   {number}(payload->'gpu_seconds') AS gs,
                   {number}(payload->'energy_joules') AS ej
            FROM {source}
            WHERE kind = 'allocation' AND payload->>'event' = 'usage'
        ), hours AS (
            SELECT t::date AS day, extract(hour FROM t)::int AS hour, cluster, node, namespace,
                   workload_kind, workload_name, COALESCE(sum(gs), 0) AS gs,
                   COALESCE(sum(ej), 0) AS ej, count(*) AS n
            FROM used WHERE t IS NOT NULL
            GROUP BY 1, 2, 3, 4, 5, 6, 7
        ), days AS (
            SELECT {", ".join(KEY)}, sum(gs) AS gs_total, sum(ej) AS ej_total, sum(n) AS n,
                   array_agg(hour) AS hours, array_agg(gs) AS gs, array_agg(ej) AS ej
            FROM hours GROUP BY {", ".join(KEY)}
        )
        INSERT INTO {rollup} AS r ({", ".join(c for c, _ in _COLUMNS)})
        SELECT {", ".join(KEY)}, gs_total, ej_total, {hourly}, n
        FROM days ORDER BY {", ".join(KEY)}
        ON CONFLICT ({", ".join(KEY)}) DO UPDATE SET
            gpu_seconds = r.gpu_seconds + EXCLUDED.gpu_seconds,
            energy_joules = r.energy_joules + EXCLUDED.energy_joules,
            {merged},
            records = r.records + EXCLUDED.records
    """


def migration(events: str) -> list[str]:
    """The rollup table, its helpers and the trigger; idempotent. Where the trigger is new
    (or its table was), the rollup is rebuilt from the usage records already stored, in the
    same transaction: CREATE TRIGGER's lock holds other writers of the events table until it
    commits, so every record is added exactly once, by the rebuild or by the trigger."""
    rollup = rollup_table(events)
    body = ",\n".join(f"            {c} {declared}" for c, declared in _COLUMNS)
    trigger = trigger_name(events)
    added = _function(events, "usage_added")
    return [
        f"""CREATE OR REPLACE FUNCTION {_function(events, "usage_time")}(value TEXT)
        RETURNS TIMESTAMPTZ LANGUAGE plpgsql IMMUTABLE AS $$
        BEGIN
            IF value IS NULL OR value !~ '^\\d{{4}}-\\d\\d-\\d\\d[T ]\\d\\d:\\d\\d' THEN
                RETURN NULL;
            END IF;
            RETURN value::timestamptz;
        EXCEPTION WHEN others THEN
            RETURN NULL;
        END $$""",
        f"""CREATE OR REPLACE FUNCTION {_function(events, "usage_number")}(value JSONB)
        RETURNS DOUBLE PRECISION LANGUAGE sql IMMUTABLE AS $$
            SELECT CASE WHEN jsonb_typeof(value) = 'number'
                         AND abs(value::numeric) < 1e300
                        THEN value::numeric::double precision END
        $$""",
        f"""CREATE OR REPLACE FUNCTION {added}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            {added_from("inserted", events).strip()};
            RETURN NULL;
        END $$""",
        f"""DO $$
        BEGIN
            IF to_regclass('{rollup}') IS NULL OR NOT EXISTS (
                SELECT 1 FROM pg_trigger
                WHERE tgrelid = to_regclass('{events}') AND tgname = '{trigger}'
            ) THEN
                DROP TRIGGER IF EXISTS {trigger} ON {events};
                CREATE TABLE IF NOT EXISTS {rollup} (
{body},
            PRIMARY KEY ({", ".join(KEY)})
                );
                CREATE TRIGGER {trigger} AFTER INSERT ON {events}
                    REFERENCING NEW TABLE AS inserted
                    FOR EACH STATEMENT EXECUTE FUNCTION {added}();
                TRUNCATE {rollup};
                {added_from(events, events).strip()};
            END IF;
        END $$""",
    ]


def current(events: str) -> str:
    """A query answering whether the rollup table and its trigger are there."""
    return f"""SELECT to_regclass('{rollup_table(events)}') IS NOT NULL AND EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgrelid = to_regclass('{events}') AND tgname = '{trigger_name(events)}')"""
