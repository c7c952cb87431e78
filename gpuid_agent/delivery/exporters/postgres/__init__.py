"""PostgreSQL exporter (asyncpg): each delivery in one transaction, idempotent by record id.

Batches are spooled already in COPY's text form (`copytext`), so a backlog drains as a few
large COPY transactions with no per-record work left (`writer` says how each table is
written and how re-sent records are skipped). Readings go to the gpuid-compatible readings
table, allocation records to the allocations table (one row per allocation, its end an update
of that row), anything else to the events table.

Each table takes its rows in a savepoint of its own: a table that cannot (missing, lacking a
column, one of its own constraints) fails its kind of record alone, named with a hint true to
POSTGRES_AUTO_MIGRATE, while the other kinds commit; the delivery then fails so the batch stays
stored, and every retry writes the joined backlog's other rows again (each only once: record
ids), so readings keep reaching their table while the allocations table is being fixed.
Auto-migration creates what is missing and adds every missing column that can be added
(nullable or with a default), from the same table definitions the writer fills.

Connections are held only while delivering: the pool keeps at most one, closed after
POSTGRES_IDLE_TIMEOUT without a delivery, and health is never probed with a connection, so a
fleet of idle nodes holds none. The pool and the migration are set up on first use (an agent
started while the database is down delivers once it is back); connections broken by a server
restart are dropped, and the worker's jittered backoff spreads the fleet's reconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from gpuid_agent.delivery.exporters.base import (
    BatchMeta,
    Exporter,
    ExporterHealth,
    StoredForm,
)
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.postgres import usage_rollup
from gpuid_agent.delivery.exporters.postgres.copytext import Payload, section
from gpuid_agent.delivery.exporters.postgres.schema import (
    MIGRATION_LOCK,
    Tables,
    expected_columns,
    history_indexes,
    migration,
)
from gpuid_agent.delivery.exporters.postgres.writer import CopyWriter, Written, table_problem
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import CorruptBatchError, ExportError

if TYPE_CHECKING:
    from prometheus_client import Counter

    from gpuid_agent.runtime.metrics import AgentMetrics

__all__ = ["PostgresExporter", "Tables"]
_log = log.get("postgres")
# One delivery of a backlog (about 17 MB of COPY text at 100,000 readings; the next one is
# read ahead): large enough that per-transaction costs vanish, small enough
# that a retry after a failure re-sends little and the server is never held for long.
COALESCE_RECORDS = 100_000
COALESCE_BYTES = 32 * 1024 * 1024
# Records encoded off the event loop above this many (a batch of thousands takes tens of ms).
_ENCODE_IN_THREAD = 1_000

# Errors after which the pool's connections cannot be trusted (server restarted, network cut).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ConnectionError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
)


def _schema_hint(auto_migrate: bool) -> str:
    if auto_migrate:
        return "POSTGRES_AUTO_MIGRATE adds missing nullable columns only: alter the table by hand"
    return "create or complete the tables, or set POSTGRES_AUTO_MIGRATE=true"


def _classify(exc: BaseException, auto_migrate: bool) -> ExportError:
    if isinstance(exc, TimeoutError):
        return ExportError(f"PostgreSQL did not answer in time: {exc}", error_type="timeout")
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        return ExportError(f"PostgreSQL refused the login: {exc}", error_type="auth")
    if isinstance(exc, _CONNECTION_ERRORS):
        return ExportError(f"PostgreSQL connection failed: {exc}", error_type="connection")
    if isinstance(exc, asyncpg.PostgresError) and table_problem(exc):
        return ExportError(f"{exc} ({_schema_hint(auto_migrate)})", error_type="schema")
    if isinstance(exc, asyncpg.DataError):
        # Rows are sanitised before COPY, so this is a value the schema cannot hold at all.
        return ExportError(
            f"PostgreSQL refused the data: {exc}", error_type="data", retryable=False
        )
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", None) or "unknown"
        return ExportError(f"PostgreSQL error {state}: {exc}", error_type="postgres")
    return ExportError(f"PostgreSQL client error: {exc!r}", error_type=type(exc).__name__)


def payload_of(records: Sequence[AnyRecord]) -> Payload:
    """A batch's rows per table in COPY text."""
    rows = rowmap.split(records)
    return Payload(
        section(rows.readings),
        section(rows.allocations),
        section(rows.events),
        (len(rows.readings), len(rows.allocations), len(rows.events)),
    )


def stored_payload(records: list[AnyRecord]) -> bytes:
    """A batch in the exporter's stored form (what its spool files hold)."""
    return payload_of(records).encode()


class PostgresExporter(Exporter):
    name = "postgres"
    stored_form = StoredForm("pgcopy", stored_payload, COALESCE_RECORDS, COALESCE_BYTES)

    def __init__(
        self,
        *,
        host: str,
        port: int = 5432,
        database: str = "gpuid",
        user: str = "gpuid",
        password: str = "",
        sslmode: str = "require",
        tables: Tables | None = None,
        auto_migrate: bool = True,
        timeout: float = 30.0,
        idle_timeout: float = 30.0,
        application_name: str = "gpuid-agent",
    ) -> None:
        self._connect: dict[str, Any] = {
            "host": host,
            "port": port,
            "database": database,
            "user": user,
            "password": password or None,
            "ssl": sslmode,
        }
        self.tables = tables or Tables.named("gpu_readings", "gpu_allocations", "gpu_events")
        self.auto_migrate = auto_migrate
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.application_name = application_name[:63]
        self._pool: asyncpg.Pool | None = None
        self._migrated = False
        self._setup = asyncio.Lock()
        self._writer = CopyWriter(self.tables)
        self._discarded: Counter | None = None
        self.discarded_records = 0
        self._constraint_logged = False

    def bind_metrics(self, metrics: AgentMetrics) -> None:
        self._discarded = metrics.discarded_records.labels(self.name, "constraint")

    async def _ready(self) -> asyncpg.Pool:
        async with self._setup:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    **self._connect,
                    min_size=0,  # no connection while idle, no reconnects while it is down
                    max_size=1,  # deliveries are sequential
                    timeout=self.timeout,
                    command_timeout=self.timeout,
                    max_inactive_connection_lifetime=self.idle_timeout,
                    # No statement outlives its transaction: safe behind PgBouncer's
                    # transaction pooling, and a short-lived connection gains nothing.
                    statement_cache_size=0,
                    server_settings={"application_name": self.application_name},
                )
            if self.auto_migrate and not self._migrated:
                self._migrated = True
                try:
                    await self.migrate(self._pool)
                except asyncpg.PostgresError as exc:
                    if not table_problem(exc):
                        raise
                    # Deliver what the tables can take; the kind that cannot says why.
                    _log.warning("PostgreSQL schema migration failed", extra={"error": str(exc)})
            return self._pool

    async def _schema_current(self, conn: asyncpg.Connection) -> bool:
        """True when every table and column the exporter writes is there, the readings'
        unique index on record_id, the indexes history reads through and the usage rollup."""
        for table, wanted in expected_columns(self.tables).items():
            found = await conn.fetch(
                """SELECT attname FROM pg_attribute WHERE attrelid = to_regclass($1)
                   AND attnum > 0 AND NOT attisdropped""",
                table,
            )
            if not wanted <= {row[0] for row in found}:
                return False
        for index, (table, _) in history_indexes(self.tables).items():
            schema = table.split(".")[0] + "." if "." in table else ""
            if await conn.fetchval("SELECT to_regclass($1)", schema + index) is None:
                return False
        if not await conn.fetchval(usage_rollup.current(self.tables.events)):
            return False
        return bool(
            await conn.fetchval(
                """SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a
                               ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                               WHERE i.indrelid = to_regclass($1) AND i.indisunique
                               AND a.attname = 'record_id')""",
                self.tables.readings,
            )
        )

    async def migrate(self, pool: asyncpg.Pool) -> None:
        """Create or complete the tables. Skipped without any lock when they are current;
        otherwise serialised across agents by an advisory lock, so a fleet starting at once
        neither races on CREATE nor queues behind ALTER TABLE needlessly.

        The lock is taken outside the DDL transaction on purpose: waiting for an advisory lock
        does not refresh the backend's catalog caches, so DDL in the same transaction could
        miss a schema another agent just created; a new transaction starts with fresh ones."""
        async with pool.acquire() as conn:
            if await self._schema_current(conn):
                return
            await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK)
            try:
                if await self._schema_current(conn):
                    return  # another agent migrated while this one waited
                async with conn.transaction():
                    for statement in migration(self.tables):
                        await conn.execute(statement)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK)
        _log.info("PostgreSQL schema migrated", extra={"tables": list(self._tables())})

    def _tables(self) -> tuple[str, str, str]:
        return (self.tables.readings, self.tables.allocations, self.tables.events)

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        records = list(batch)
        if len(records) > _ENCODE_IN_THREAD:
            await self._deliver(await asyncio.to_thread(payload_of, records))
        else:
            await self._deliver(payload_of(records))

    async def export_stored(self, payloads: Sequence[bytes], meta: BatchMeta) -> None:
        try:
            payload = Payload.join_encoded(payloads)
        except CorruptBatchError as exc:
            raise ExportError(
                f"stored batch unreadable: {exc}", error_type="data", retryable=False
            ) from exc
        await self._deliver(payload)

    async def _deliver(self, payload: Payload) -> None:
        try:
            pool = await self._ready()
            async with pool.acquire() as conn:
                written = await self._writer.write(conn, payload)
        except ExportError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = _classify(exc, self.auto_migrate)
            if error.error_type in ("connection", "timeout") and self._pool is not None:
                await self._pool.expire_connections()  # reconnect on next use
            if error.error_type == "schema":
                self._migrated = False  # a table changed under the agent: migrate again
            raise error from exc
        if written.dropped:
            self._count_discarded(written)
        if written.failed:
            self._migrated = False
            raise ExportError(
                "; ".join(f"{t}: {exc}" for t, exc in sorted(written.failed.items()))
                + f" ({_schema_hint(self.auto_migrate)}); the other tables took their rows",
                error_type="schema",
            )

    def _count_discarded(self, written: Written) -> None:
        self.discarded_records += written.dropped
        if self._discarded is not None:
            self._discarded.inc(written.dropped)
        if self._constraint_logged:
            return  # once per process; the counter has the rest
        self._constraint_logged = True
        constraint = written.constraint or "<name from \\d " + self.tables.readings + ">"
        _log.error(
            "readings dropped by a unique constraint of the readings table (a table gpuid "
            "created?): both dies of a GB200 superchip share a serial, so its UNIQUE keeps only "
            "one; record_id already makes every row unique. Fix: "
            f"ALTER TABLE {self.tables.readings} DROP CONSTRAINT {constraint};",
            extra={
                "table": self.tables.readings,
                "constraint": written.constraint,
                "records": written.dropped,
            },
        )

    async def health(self) -> ExporterHealth:
        """No round trip: a probe would hold a connection on every idle node of the fleet.
        The worker's own deliveries say whether the database takes records."""
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), 5.0)
            except Exception:  # a pool that cannot close politely is cut
                pool.terminate()
