"""PostgreSQL exporter (asyncpg): each batch in one transaction, idempotent by record id.

Readings are COPYed straight into their table after one index probe drops the ids already
stored; allocations and other kinds (and readings, should the unique index refuse that COPY)
go through per-connection staging tables and `INSERT … SELECT … ON CONFLICT`. Either way a
re-sent batch (a retry, or a spooled batch re-sent after a crash) stores nothing twice.
Readings go to the gpuid-compatible readings table, allocation records to the allocations
table (one row per allocation, its end an update of that row), anything else to the events
table. The pool and the migration are set up on first use, so an agent started while the
database is down comes up and delivers once it is back; connections broken by a server
restart are dropped and replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter, ExporterHealth, Record
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.postgres.schema import (
    MIGRATION_LOCK,
    STAGE_ALLOCATIONS,
    STAGE_EVENTS,
    STAGE_READINGS,
    STAGING,
    Tables,
    insert_events,
    insert_readings,
    migration,
    stored_ids,
    upsert_allocations,
)
from gpuid_agent.runtime import log
from gpuid_agent.runtime.errors import ExportError

if TYPE_CHECKING:
    from gpuid_agent.runtime.config import Settings

__all__ = ["PostgresExporter", "Tables"]
_log = log.get("postgres")
_RECORD_ID = rowmap.READING_COLUMNS.index("record_id")

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


def _classify(exc: BaseException) -> ExportError:
    if isinstance(exc, TimeoutError):
        return ExportError(f"PostgreSQL did not answer in time: {exc}", error_type="timeout")
    if isinstance(
        exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError
    ):
        return ExportError(f"PostgreSQL refused the login: {exc}", error_type="auth")
    if isinstance(exc, _CONNECTION_ERRORS):
        return ExportError(f"PostgreSQL connection failed: {exc}", error_type="connection")
    if isinstance(exc, asyncpg.UndefinedTableError | asyncpg.UndefinedColumnError):
        return ExportError(
            f"{exc} (create the tables, or set POSTGRES_AUTO_MIGRATE=true)", error_type="schema"
        )
    if isinstance(exc, asyncpg.DataError):
        # Rows are sanitised before COPY, so this is a value the schema cannot hold at all.
        return ExportError(
            f"PostgreSQL refused the data: {exc}", error_type="data", retryable=False
        )
    if isinstance(exc, asyncpg.PostgresError):
        state = getattr(exc, "sqlstate", None) or "unknown"
        return ExportError(f"PostgreSQL error {state}: {exc}", error_type="postgres")
    return ExportError(f"PostgreSQL client error: {exc!r}", error_type=type(exc).__name__)


class PostgresExporter(Exporter):
    name = "postgres"

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
        pool_size: int = 2,
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
        self.pool_size = max(1, pool_size)
        self._pool: asyncpg.Pool | None = None
        self._migrated = False
        # COPY quotes the names it is given: pass them folded as PostgreSQL folds them.
        schema, _, bare = self.tables.readings.lower().rpartition(".")
        self._readings_name = (schema or None, bare)
        self._setup = asyncio.Lock()
        self._sql = (
            insert_readings(self.tables),
            upsert_allocations(self.tables),
            insert_events(self.tables),
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> PostgresExporter:
        return cls(
            host=settings.postgres_host,
            port=settings.postgres_port,
            database=settings.postgres_db,
            user=settings.postgres_user,
            password=settings.postgres_password.get_secret_value(),
            sslmode=settings.postgres_sslmode,
            tables=Tables.named(
                settings.postgres_table,
                settings.postgres_allocations_table,
                settings.postgres_events_table,
            ),
            auto_migrate=settings.postgres_auto_migrate,
            timeout=settings.timeout,
        )

    @staticmethod
    async def _init_connection(conn: asyncpg.Connection) -> None:
        for statement in STAGING:
            await conn.execute(statement)

    async def _ready(self) -> asyncpg.Pool:
        async with self._setup:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    **self._connect,
                    min_size=0,  # no background reconnects while the server is down
                    max_size=self.pool_size,
                    timeout=self.timeout,
                    command_timeout=self.timeout,
                    max_inactive_connection_lifetime=300.0,
                    init=self._init_connection,
                    server_settings={"application_name": "gpuid-agent"},
                )
            if self.auto_migrate and not self._migrated:
                await self.migrate(self._pool)
                self._migrated = True
            return self._pool

    async def _schema_current(self, conn: asyncpg.Connection) -> bool:
        """True when every table, column and unique index the exporter writes is there."""
        t = self.tables
        found = await conn.fetchval(
            """SELECT count(*) FROM pg_attribute
               WHERE attrelid = to_regclass($1) AND attname = 'attributes' AND NOT attisdropped""",
            t.readings,
        )
        if not found:
            return False
        return bool(
            await conn.fetchval(
                """SELECT to_regclass($1) IS NOT NULL AND to_regclass($2) IS NOT NULL
                   AND EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a
                               ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                               WHERE i.indrelid = to_regclass($3) AND i.indisunique
                               AND a.attname = 'record_id')""",
                t.allocations,
                t.events,
                t.readings,
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

    async def _stage(
        self,
        conn: asyncpg.Connection,
        staged: str,
        columns: tuple[str, ...],
        sql: str,
        data: list[tuple[Any, ...]],
    ) -> None:
        await conn.copy_records_to_table(staged, records=data, columns=columns)
        await conn.execute(sql)

    async def _write_readings(self, conn: asyncpg.Connection, data: list[tuple[Any, ...]]) -> None:
        """Readings, the bulk of any backlog, take a faster path than staging: drop the rows
        whose record_id is already stored (one index probe for the batch), COPY the rest
        straight into the table. Should a row arrive from elsewhere in between, the unique
        index refuses the COPY and the batch takes the staging path, which skips conflicts."""
        ids = [row[_RECORD_ID] for row in data]
        stored = {r[0] for r in await conn.fetch(stored_ids(self.tables), ids)}
        fresh: list[tuple[Any, ...]] = []
        for row in data:
            if row[_RECORD_ID] not in stored:
                stored.add(row[_RECORD_ID])  # a record twice in one batch is stored once
                fresh.append(row)
        if not fresh:
            return
        try:
            async with conn.transaction():  # a savepoint: a refused COPY leaves the rest intact
                await conn.copy_records_to_table(
                    self._readings_name[1],
                    schema_name=self._readings_name[0],
                    records=fresh,
                    columns=rowmap.READING_COLUMNS,
                )
        except asyncpg.UniqueViolationError:
            await self._stage(conn, STAGE_READINGS, rowmap.READING_COLUMNS, self._sql[0], fresh)

    async def _write(self, pool: asyncpg.Pool, batch: Sequence[Record]) -> None:
        rows = rowmap.split(batch)
        _, allocations_sql, events_sql = self._sql
        async with pool.acquire() as conn, conn.transaction():
            if rows.readings:
                await self._write_readings(conn, rows.readings)
            if rows.allocations:
                await self._stage(
                    conn,
                    STAGE_ALLOCATIONS,
                    rowmap.ALLOCATION_COLUMNS,
                    allocations_sql,
                    rows.allocations,
                )
            if rows.events:
                await self._stage(conn, STAGE_EVENTS, rowmap.EVENT_COLUMNS, events_sql, rows.events)

    async def export(self, batch: Sequence[Record], meta: BatchMeta | None = None) -> None:
        try:
            pool = await self._ready()
            await self._write(pool, batch)
        except ExportError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = _classify(exc)
            if error.error_type in ("connection", "timeout") and self._pool is not None:
                await self._pool.expire_connections()  # reconnect on next use
            raise error from exc

    async def health(self) -> ExporterHealth:
        """A real round trip: a connection from the pool answers SELECT 1."""
        try:
            pool = await self._ready()
            async with pool.acquire(timeout=self.timeout) as conn:
                await conn.fetchval("SELECT 1", timeout=self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._pool is not None and isinstance(exc, (*_CONNECTION_ERRORS, TimeoutError)):
                await self._pool.expire_connections()
            return ExporterHealth(ok=False, reason=str(_classify(exc)))
        return ExporterHealth(ok=True)

    async def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            try:
                await asyncio.wait_for(pool.close(), 5.0)
            except Exception:  # a pool that cannot close politely is cut
                pool.terminate()
