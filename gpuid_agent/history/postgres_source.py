"""The PostgreSQL exporter's tables as a source of records (asyncpg, one connection).

Every question reads through an index the exporter's migration creates (docs/history.md says
which serves which), and usage through its rollup table (`<events table>_usage`, kept by the
database as usage records arrive), so each answers in well under a second on a fleet's
month. A connection or table problem names the setting to fix.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg
import orjson

from gpuid_agent.history.facts import Holding, Mark, Sighting, UsageAmount, mark, number
from gpuid_agent.history.source import Where
from gpuid_agent.runtime.errors import RecordsUnreachableError

if TYPE_CHECKING:
    from gpuid_agent.runtime.config import Settings

T = TypeVar("T")
CONNECT_TIMEOUT = 10.0
QUERY_TIMEOUT = 120.0

_SIGHTING = """read_time, cluster, node, machine, chassis, gpu, COALESCE(uuid, ''),
    COALESCE(pci_bus_id, ''), COALESCE(model, ''), change IS NOT DISTINCT FROM 'removed'"""
_HOLDING = """allocation_id, cluster, node, gpu, COALESCE(uuid, ''), COALESCE(mig_uuid, ''),
    COALESCE(namespace, ''), COALESCE(pod, ''), COALESCE(pod_uid, ''), COALESCE(container, ''),
    COALESCE(workload_kind, ''), COALESCE(workload_name, ''), started_at, ended_at,
    gpu_seconds, energy_joules"""
_MARKS = "kind IN ('health', 'hardware')"
_AMOUNT = "CASE WHEN jsonb_typeof(payload->'{0}') = 'number' THEN (payload->>'{0}')::numeric END"


def _in_schema_of(readings: str, name: str) -> str:
    """A bare table name goes into the readings table's schema, as the exporter places it."""
    if "." in name or "." not in readings:
        return name
    return f"{readings.split('.', maxsplit=1)[0]}.{name}"


class PostgresSource:
    name = "PostgreSQL"

    def __init__(self, settings: Settings) -> None:
        self._where = f"{settings.postgres_host}:{settings.postgres_port}"
        self._connect: dict[str, Any] = {
            "host": settings.postgres_host,
            "port": settings.postgres_port,
            "database": settings.postgres_db,
            "user": settings.postgres_user,
            "password": settings.postgres_password.get_secret_value() or None,
            "ssl": settings.postgres_sslmode,
            "timeout": CONNECT_TIMEOUT,
            "command_timeout": QUERY_TIMEOUT,
            "statement_cache_size": 0,  # a few statements, each run once or twice
            "server_settings": {"application_name": "gpuid-agent history"},
        }
        self._db = settings.postgres_db
        r = settings.postgres_table
        self.readings = r
        self.allocations = _in_schema_of(r, settings.postgres_allocations_table)
        self.events = _in_schema_of(r, settings.postgres_events_table)
        self.rollup = f"{self.events}_usage"
        self._runner = asyncio.Runner()
        self._conn: asyncpg.Connection | None = None

    # ---- connection and errors -----------------------------------------------------------

    async def _connection(self) -> asyncpg.Connection:
        if self._conn is None:
            try:
                self._conn = await asyncpg.connect(**self._connect)
            except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError):
                raise RecordsUnreachableError(
                    f"PostgreSQL at {self._where} refused the login: "
                    "check POSTGRES_USER and POSTGRES_PASSWORD"
                ) from None
            except asyncpg.InvalidCatalogNameError:
                raise RecordsUnreachableError(
                    f"PostgreSQL at {self._where} has no database {self._db!r}: check POSTGRES_DB"
                ) from None
            except ssl.SSLError as exc:
                raise RecordsUnreachableError(
                    f"TLS with PostgreSQL at {self._where} failed ({exc.reason or exc}): "
                    "check POSTGRES_SSLMODE"
                ) from None
            except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                raise RecordsUnreachableError(self._unreachable(exc)) from None
        return self._conn

    def _unreachable(self, exc: BaseException) -> str:
        why = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve PostgreSQL host {self._where} ({why}): check POSTGRES_HOST"
        hint = "check POSTGRES_HOST and POSTGRES_PORT"
        if "ssl" in why.lower():
            hint = "check POSTGRES_SSLMODE"
        return f"cannot reach PostgreSQL at {self._where} ({why}): {hint}"

    def _run(self, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        async def ask() -> T:
            conn = await self._connection()
            try:
                return await work(conn)
            except asyncpg.UndefinedTableError as exc:
                raise RecordsUnreachableError(
                    f"PostgreSQL: {exc}: check POSTGRES_TABLE, POSTGRES_ALLOCATIONS_TABLE and "
                    "POSTGRES_EVENTS_TABLE (an agent of this version creates the tables at its "
                    "first delivery)"
                ) from None
            except (asyncpg.PostgresError, OSError, TimeoutError) as exc:
                raise RecordsUnreachableError(f"PostgreSQL at {self._where}: {exc}") from None

        return self._runner.run(ask())

    def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            self._runner.run(conn.close(timeout=5))
        self._runner.close()

    # ---- the statements (each with its arguments), as the questions run them ------------

    def _filters(self, where: Where, args: list[Any]) -> str:
        if where.cluster is None:
            return ""
        args.append(where.cluster)
        return f" AND cluster = ${len(args)}"

    def sightings_query(self, where: Where) -> tuple[str, list[Any]]:
        """By serial: `idx_<readings>_gpu`; by node and time: `idx_<readings>_node_time`."""
        args: list[Any]
        if where.serial is not None:
            args, condition = [where.serial], "gpu = $1"
        else:
            args = [where.node, where.since, where.until]
            condition = "node = $1 AND read_time >= $2 AND read_time <= $3"
        sql = f"SELECT {_SIGHTING} FROM {self.readings} WHERE {condition}"
        return sql + self._filters(where, args) + " ORDER BY read_time", args

    def holdings_query(self, where: Where) -> tuple[str, list[Any]]:
        """By pod: `idx_<allocations>_pod`; by serial: `_gpu`; by node: `_node_started`."""
        args: list[Any]
        if where.pod is not None:
            args, condition = [where.namespace, where.pod], "namespace = $1 AND pod = $2"
        elif where.serial is not None:
            args, condition = [where.serial], "gpu = $1"
        else:
            args = [where.node, where.since, where.until]
            condition = "node = $1 AND started_at <= $3 AND (ended_at IS NULL OR ended_at >= $2)"
        sql = f"SELECT {_HOLDING} FROM {self.allocations} WHERE {condition}"
        return sql + self._filters(where, args) + " ORDER BY started_at, allocation_id", args

    def so_far_query(self, node: str, since: datetime, ids: list[str]) -> tuple[str, list[Any]]:
        """Open allocations' usage records on one node since the earliest start:
        `idx_<events>_node_kind_time`."""
        sql = f"""SELECT payload->>'allocation_id', sum({_AMOUNT.format("gpu_seconds")}),
                         sum({_AMOUNT.format("energy_joules")})
                  FROM {self.events}
                  WHERE node = $1 AND kind = 'allocation' AND observed_at >= $2
                    AND payload->>'event' = 'usage' AND payload->>'allocation_id' = ANY($3::text[])
                  GROUP BY 1"""
        return sql, [node, since, ids]

    def marks_query(self, where: Where) -> tuple[str, list[Any]]:
        """By serial: `idx_<events>_gpu` or `_old_serial`; by node: `_node_kind_time`."""
        args: list[Any]
        if where.serial is not None:
            args = [where.serial]
            condition = (
                f"(({_MARKS} AND payload->>'gpu' = $1) "
                "OR (kind = 'hardware' AND payload->>'old_serial' = $1))"
            )
        else:
            args = [where.node, where.since, where.until]
            condition = f"node = $1 AND {_MARKS} AND observed_at >= $2 AND observed_at <= $3"
        sql = f"SELECT payload::text FROM {self.events} WHERE {condition}"
        return sql + self._filters(where, args) + " ORDER BY observed_at", args

    def usage_query(
        self, since: datetime, until: datetime, cluster: str | None
    ) -> tuple[str, list[Any]]:
        """The rollup through `idx_<rollup>_totals`: the whole days between the ends from the
        index alone (one narrow entry per node, day and workload), the hours of the day at
        either end from their rows' hourly arrays."""
        args: list[Any] = [since.date(), since.hour, until.date(), until.hour]
        where = self._filters(Where(cluster=cluster), args)
        hours = ", ".join(
            f"""(SELECT COALESCE(sum(x), 0) FROM unnest({hourly}[
                    (CASE WHEN day = $1 THEN $2 + 1 ELSE 1 END):
                    (CASE WHEN day = $3 THEN $4 ELSE 24 END)]) AS x)"""
            for hourly in ("hourly_gpu_seconds", "hourly_energy_joules")
        )
        sql = f"""
            SELECT namespace, workload_kind, workload_name, sum(gs), sum(ej) FROM (
                SELECT namespace, workload_kind, workload_name, gpu_seconds AS gs,
                       energy_joules AS ej
                FROM {self.rollup} WHERE day > $1 AND day < $3{where}
                UNION ALL
                SELECT namespace, workload_kind, workload_name, {hours}
                FROM {self.rollup} WHERE (day = $1 OR day = $3){where}
            ) AS used
            GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"""
        return sql, args

    # ---- the Source protocol -------------------------------------------------------------

    def sightings(self, where: Where) -> list[Sighting]:
        sql, args = self.sightings_query(where)
        return [Sighting(*row) for row in self._run(lambda c: c.fetch(sql, *args))]

    def holdings(self, where: Where) -> list[Holding]:
        sql, args = self.holdings_query(where)

        async def ask(conn: asyncpg.Connection) -> list[Holding]:
            found = [Holding(*row) for row in await conn.fetch(sql, *args)]
            return await self._so_far(conn, found)

        return self._run(ask)

    async def _so_far(self, conn: asyncpg.Connection, found: list[Holding]) -> list[Holding]:
        """Open allocations with the sum of their usage records so far."""
        open_by_node: dict[str, list[Holding]] = {}
        for h in found:
            if h.ended_at is None and h.started_at is not None:
                open_by_node.setdefault(h.node, []).append(h)
        used: dict[str, tuple[float | None, float | None]] = {}
        for node, held in open_by_node.items():
            since = min(h.started_at for h in held if h.started_at is not None)
            sql, args = self.so_far_query(node, since, [h.allocation_id for h in held])
            rows = await conn.fetch(sql, *args)
            used |= {r[0]: (_float(r[1]), _float(r[2])) for r in rows}
        return [
            replace(h, gpu_seconds=used[h.allocation_id][0], energy_joules=used[h.allocation_id][1])
            if h.allocation_id in used and h.ended_at is None
            else h
            for h in found
        ]

    def marks(self, where: Where) -> list[Mark]:
        sql, args = self.marks_query(where)
        rows = self._run(lambda c: c.fetch(sql, *args))
        found = (mark(orjson.loads(row[0])) for row in rows)
        return [m for m in found if m is not None]

    def usage(self, since: datetime, until: datetime, cluster: str | None) -> list[UsageAmount]:
        sql, args = self.usage_query(since, until, cluster)
        rows = self._run(lambda c: c.fetch(sql, *args))
        return [UsageAmount(r[0], r[1], r[2], float(r[3]), float(r[4])) for r in rows]


def _float(value: Any) -> float | None:
    return None if value is None else number(float(value))
