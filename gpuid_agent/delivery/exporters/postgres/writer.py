"""One delivery (one or many stored batches, joined) written in one transaction.

Readings, the bulk of any backlog, are COPYed straight into their table inside a savepoint:
with no record stored yet — the usual case — that is all. If the unique index on `record_id`
refuses the COPY (a batch re-sent after a lost answer or a crash), one index probe drops the
ids already stored and the rest is COPYed again; should that be refused too (a row arrived in
between, or another unique constraint applies), the rows go through a staging table and
`INSERT … ON CONFLICT DO NOTHING`. Allocations and events always take staging (they are few,
and an allocation's end updates its row). Staging tables are created inside the transaction
and dropped at its end, so no state outlives a transaction (PgBouncer's transaction pooling).

A table created by gpuid keeps its UNIQUE over the gpuid columns, which both dies of a GB200
superchip share: rows such a constraint drops are counted, not hidden (`dropped` of `write`).

Each table is written in a savepoint of its own: a table that cannot take its rows (missing,
missing a column, a type or constraint of its own) fails that kind alone (`failed` of
`write`), and the others commit. A lost connection or a value no table can hold fails all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.postgres.copytext import Payload, column_values, keep_lines
from gpuid_agent.delivery.exporters.postgres.schema import (
    STAGE_ALLOCATIONS,
    STAGE_EVENTS,
    STAGE_READINGS,
    STAGING,
    Tables,
    counted,
    insert_events,
    insert_readings,
    refused_readings,
    stored_ids,
    upsert_allocations,
)

_RECORD_ID = rowmap.READING_COLUMNS.index("record_id")


@dataclass(slots=True)
class Written:
    """What one delivery did beyond storing its rows."""

    dropped: int = 0  # readings a unique constraint other than record_id's refused
    constraint: str | None = None  # that constraint, when one was named
    failed: dict[str, asyncpg.PostgresError] = field(default_factory=dict)  # table → why


class CopyWriter:
    def __init__(self, tables: Tables) -> None:
        self.tables = tables
        # COPY quotes the names it is given: pass them folded as PostgreSQL folds them.
        schema, _, bare = tables.readings.lower().rpartition(".")
        self._readings = (schema or None, bare)
        self._insert_readings = counted(insert_readings(tables))
        self._upsert_allocations = upsert_allocations(tables)
        self._insert_events = insert_events(tables)
        # Set once a unique constraint other than record_id's refused a COPY: from then on
        # readings go through staging at once instead of failing a COPY first.
        self.other_unique: str | None = None

    async def write(self, conn: asyncpg.Connection, payload: Payload) -> Written:
        written = Written()
        t = self.tables

        async def allocations() -> None:
            await self._stage(conn, 1, payload.allocations)
            await conn.execute(self._upsert_allocations)

        async def events() -> None:
            await self._stage(conn, 2, payload.events)
            await conn.execute(self._insert_events)

        async with conn.transaction():
            if payload.readings:
                await self._alone(
                    conn,
                    t.readings,
                    lambda: self._readings_rows(conn, payload.readings, written),
                    written,
                )
            if payload.allocations:
                await self._alone(conn, t.allocations, allocations, written)
            if payload.events:
                await self._alone(conn, t.events, events, written)
        return written

    async def _alone(
        self,
        conn: asyncpg.Connection,
        table: str,
        write: Callable[[], Awaitable[None]],
        written: Written,
    ) -> None:
        """One table's rows in a savepoint: what only that table refuses fails it alone."""
        try:
            async with conn.transaction():
                await write()
        except asyncpg.PostgresError as exc:
            if not table_problem(exc):
                raise
            written.failed[table] = exc

    async def _copy(self, conn: asyncpg.Connection, data: bytes) -> None:
        async with conn.transaction():  # a savepoint: a refused COPY leaves the rest intact
            await conn.copy_to_table(
                self._readings[1],
                schema_name=self._readings[0],
                source=_chunks(data),
                columns=rowmap.READING_COLUMNS,
            )

    def _refused_by(self, exc: asyncpg.UniqueViolationError) -> str | None:
        """The other unique constraint that refused a COPY, or None for record_id's index."""
        name = getattr(exc, "constraint_name", None) or ""
        detail = getattr(exc, "detail", None) or ""
        if detail.startswith("Key (record_id)="):
            return None
        return name or "unnamed unique constraint"

    async def _readings_rows(self, conn: asyncpg.Connection, data: bytes, out: Written) -> None:
        if self.other_unique is None:
            try:
                await self._copy(conn, data)
                return
            except asyncpg.UniqueViolationError as exc:
                self.other_unique = self._refused_by(exc)
        ids = list(dict.fromkeys(column_values(data, _RECORD_ID)))
        stored = {r[0] for r in await conn.fetch(stored_ids(self.tables), ids)}
        fresh, count = keep_lines(data, _RECORD_ID, stored)
        if not count:
            return
        if self.other_unique is None:
            try:
                await self._copy(conn, fresh)
                return
            except asyncpg.UniqueViolationError as exc:
                self.other_unique = self._refused_by(exc)
        await self._stage(conn, 0, fresh)
        inserted = await conn.fetchval(self._insert_readings)
        if inserted < count:
            # Rows not inserted whose record_id the table still lacks were refused by
            # another constraint; the others arrived in between (already stored).
            missing = await conn.fetchval(refused_readings(self.tables))
            out.dropped += int(missing or 0)
            out.constraint = self.other_unique

    async def _stage(self, conn: asyncpg.Connection, which: int, data: bytes) -> None:
        name = (STAGE_READINGS, STAGE_ALLOCATIONS, STAGE_EVENTS)[which]
        columns = (rowmap.READING_COLUMNS, rowmap.ALLOCATION_COLUMNS, rowmap.EVENT_COLUMNS)[which]
        await conn.execute(STAGING[which])
        await conn.copy_to_table(name, source=_chunks(data), columns=columns)


async def _chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[memoryview]:
    """COPY's input straight from memory (a file-like source would be read in a thread)."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield view[start : start + size]


def table_problem(exc: asyncpg.PostgresError) -> bool:
    """An error of one table's making (its definition or privileges), not of the connection
    or of a value: SQLSTATE classes 42 (undefined table or column, type mismatch, privilege),
    3F (schema) and 23 (a constraint of the table's own: NOT NULL, CHECK, foreign key)."""
    state = getattr(exc, "sqlstate", None) or ""
    return state[:2] in ("42", "3F", "23")
