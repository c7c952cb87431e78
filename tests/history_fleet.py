"""A fleet's records generated inside PostgreSQL (generate_series), in the exporter's tables,
for the history questions at scale: `nox -s bench` times them on 10,000 nodes x 30 days, the
tests read the plans on a small one.

Each node has four GPUs (serial `SN<node * 4 + slot>`) under a chassis shared by 18 nodes (an
NVL72 rack), and reports a heartbeat reading per GPU every hour. Pods come in six-hour slots
(a node's slot starts are offset by its number): each pod holds the node's four GPUs for
4.5 to 6 hours, in one of 40 namespaces and 400 workloads; the last pod of each node is still
running at the end. Every open hour of an allocation has its usage record, as the agent's
hourly accounting period makes them. Every 500th node has GPU 0 replaced on day 10; the old
serial turns up on the next node's GPU 3 on day 12, replacing that one in turn. A GPU in 200
has an XID 13 a day, cleared an hour later. Rows go in time order, as a fleet writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from gpuid_agent.delivery.exporters.postgres import usage_rollup
from gpuid_agent.delivery.exporters.postgres.schema import Tables, migration
from tests.servers.postgres import PostgresCluster

START = datetime(2025, 3, 1, tzinfo=UTC)
GPUS = 4
RACK = 18
SLOT_HOURS = 6


@dataclass(frozen=True, slots=True)
class Fleet:
    nodes: int
    days: int

    @property
    def end(self) -> datetime:
        return START + timedelta(days=self.days)


def node_name(n: int) -> str:
    return f"node-{n:05d}"


def serial(n: int, gpu: int) -> str:
    return f"SN{n * GPUS + gpu}"


# The serial in slot g of node n at time t: replacements on day 10 (every 500th node's GPU 0)
# and day 12 (the next node's GPU 3 takes the serial removed on day 10).
_SERIAL = f"""CASE
    WHEN n % 500 = 7 AND g = 0 AND t >= $1::timestamptz + interval '10 days'
        THEN 'SNR' || n
    WHEN n % 500 = 8 AND g = 3 AND t >= $1::timestamptz + interval '12 days'
        THEN 'SN' || ((n - 1) * {GPUS})
    ELSE 'SN' || (n * {GPUS} + g) END"""


def _readings(tables: Tables) -> str:
    return f"""
        INSERT INTO {tables.readings} (cluster, node, machine, source, chassis, gpu, read_time,
            record_id, schema_version, uuid, gpu_index, model, pci_bus_id, module_id,
            board_part_number, driver_version, machine_source, mig_devices, reason, change)
        SELECT 'fleet', 'node-' || lpad(n::text, 5, '0'), 'i-' || md5(n::text),
               'gpuid-agent/1.0.0', 'CH-' || (n / {RACK}), {_SERIAL}, t,
               md5(n || '/' || g || '/' || t), 1, 'GPU-' || md5({_SERIAL}), g, 'NVIDIA GB200',
               '0000000' || g || ':' || lpad(to_hex(n % 256), 2, '0') || ':00.0', g + 1,
               '699-2G548-1200-000', '570.124.06', 'provider-id', '{{}}', 'heartbeat',
               'unchanged'
        FROM generate_series($5::timestamptz, $6::timestamptz - interval '1 hour',
                             interval '1 hour') AS t,
             generate_series(0, $3 - 1) AS n, generate_series(0, {GPUS - 1}) AS g
        ORDER BY t
    """


# A node's pods: slot k starts at START + n % 6 hours + 6k hours and lasts 4.5 to 6 hours.
# Parameters of every statement: $1 START, $2 the end, $3 nodes, $4 days; $5 and $6 a day.
_SLOTS = f"""
    SELECT n, k, started_at, ends,
           'team-' || (hashint4(n + k * 31) & 2147483647) % 40 AS namespace,
           'wl-' || (hashint4(n * 13 + k) & 2147483647) % 400 AS workload
    FROM generate_series(0, $3 - 1) AS n,
         LATERAL generate_series(0, ($4::int * 24) / {SLOT_HOURS}) AS k,
         LATERAL (SELECT $1::timestamptz
                         + interval '1 hour' * (n % {SLOT_HOURS} + k * {SLOT_HOURS}) AS started_at)
                 AS s,
         LATERAL (SELECT started_at + interval '1 hour'
                         * ({SLOT_HOURS} - (hashint4(n * 7919 + k) & 3) * 0.5) AS ends) AS e
    WHERE started_at < $2::timestamptz
"""


def _allocations(tables: Tables) -> str:
    return f"""
        WITH slots AS ({_SLOTS}), held AS (
            SELECT slots.*, g, (CASE WHEN ends > $2::timestamptz THEN NULL ELSE ends END)
                   AS ended_at, {_SERIAL.replace("t >=", "started_at >=")} AS gpu
            FROM slots, generate_series(0, {GPUS - 1}) AS g
        )
        INSERT INTO {tables.allocations} (allocation_id, cluster, node, machine, gpu, uuid,
            namespace, pod, pod_uid, container, resource_name, device_id, workload_kind,
            workload_name, started_at, ended_at, gpu_seconds, energy_joules, start_record_id,
            end_record_id)
        SELECT md5('a/' || n || '/' || k || '/' || g), 'fleet', 'node-' || lpad(n::text, 5, '0'),
               'i-' || md5(n::text), gpu, 'GPU-' || md5(gpu), namespace,
               'job-' || n || '-' || k, md5('pod/' || n || '/' || k), 'main', 'nvidia.com/gpu',
               'GPU-' || md5(gpu), 'Job', workload, started_at, ended_at,
               extract(epoch FROM ended_at - started_at),
               extract(epoch FROM ended_at - started_at) * 700,
               md5('s/' || n || '/' || k || '/' || g),
               CASE WHEN ended_at IS NOT NULL THEN md5('e/' || n || '/' || k || '/' || g) END
        FROM held ORDER BY started_at
    """


def _stamp(column: str) -> str:
    """The record's RFC 3339 form of a time column."""
    return f"""to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"')"""


_PERIODS = f"""
    WITH slots AS ({_SLOTS} AND started_at < $6 AND ends > $5), periods AS (
        SELECT slots.*, g, greatest(h, started_at) AS usage_start,
               least(h + interval '1 hour', ends, $2::timestamptz) AS read_time,
               {_SERIAL.replace("t >=", "started_at >=")} AS gpu
        FROM slots, generate_series(0, {GPUS - 1}) AS g,
             LATERAL generate_series(date_trunc('hour', started_at), ends, interval '1 hour')
             AS h
        WHERE h >= $5::timestamptz AND h < $6::timestamptz AND h < ends
          AND h < $2::timestamptz
    )
    SELECT * FROM periods ORDER BY read_time
"""


def _usage(tables: Tables) -> str:
    """Usage records of the hours in [$5, $6): one per allocation and hour it was open."""
    return f"""
        INSERT INTO {tables.events} (record_id, kind, cluster, node, machine, observed_at,
                                     payload)
        SELECT md5('u/' || n || '/' || k || '/' || g || '/' || usage_start), 'allocation',
               'fleet', 'node-' || lpad(n::text, 5, '0'), 'i-' || md5(n::text), read_time,
               jsonb_build_object(
                   'schema_version', 1, 'kind', 'allocation',
                   'record_id', md5('u/' || n || '/' || k || '/' || g || '/' || usage_start),
                   'event', 'usage', 'cluster', 'fleet',
                   'node', 'node-' || lpad(n::text, 5, '0'), 'machine', 'i-' || md5(n::text),
                   'machine_source', 'provider-id', 'source', 'gpuid-agent/1.0.0',
                   'chassis', 'CH-' || (n / {RACK}), 'gpu', gpu,
                   'read_time', {_stamp("read_time")},
                   'allocation_id', md5('a/' || n || '/' || k || '/' || g), 'serial', gpu,
                   'uuid', 'GPU-' || md5(gpu), 'gpu_index', g, 'mig_uuid', NULL,
                   'mig_gpu_instance_id', NULL, 'mig_profile', NULL, 'namespace', namespace,
                   'pod', 'job-' || n || '-' || k, 'pod_uid', md5('pod/' || n || '/' || k),
                   'container', 'main', 'resource_name', 'nvidia.com/gpu',
                   'device_id', 'GPU-' || md5(gpu), 'replica', NULL, 'workload_kind', 'Job',
                   'workload_name', workload, 'started_at', {_stamp("started_at")},
                   'start_observed', true, 'ended_at', NULL, 'end_observed', NULL,
                   'gpu_seconds', extract(epoch FROM read_time - usage_start),
                   'energy_joules', extract(epoch FROM read_time - usage_start) * 700,
                   'usage_start', {_stamp("usage_start")})
        FROM ({_PERIODS}) AS periods
    """


def _usage_summed(tables: Tables) -> str:
    """The same hours added to the usage rollup alone, as its trigger would have (the
    payload holds only what the rollup reads)."""
    generated = f"""(
        SELECT 'allocation' AS kind, 'fleet' AS cluster, 'node-' || lpad(n::text, 5, '0') AS node,
               jsonb_build_object('event', 'usage', 'namespace', namespace,
                   'workload_kind', 'Job', 'workload_name', workload,
                   'gpu_seconds', extract(epoch FROM read_time - usage_start),
                   'energy_joules', extract(epoch FROM read_time - usage_start) * 700,
                   'usage_start', {_stamp("usage_start")}) AS payload
        FROM ({_PERIODS}) AS periods) AS generated"""
    return usage_rollup.added_from(generated, tables.events)


def _marks(tables: Tables) -> str:
    """XID 13 on one GPU in 200 a day (and its clearing), and the replacements above."""
    return f"""
        WITH xids AS (
            SELECT n, g, d, $1::timestamptz + interval '1 day' * d
                   + interval '1 minute' * ((hashint4(n * 4 + g + d) & 2147483647) % 1380) AS t
            FROM generate_series(0, $3 - 1) AS n, generate_series(0, {GPUS - 1}) AS g,
                 generate_series(0, $4 - 1) AS d
            WHERE (hashint4(n * 4 + g + d * 100003) & 2147483647) % 200 = 0
        ), health AS (
            SELECT n, g, t, 'degraded' AS state, 'healthy' AS previous, 'check_workload' AS action,
                   'XID 13: graphics engine exception' AS reason FROM xids
            UNION ALL
            SELECT n, g, t + interval '1 hour', 'healthy', 'degraded', 'none', NULL FROM xids
        ), swaps AS (
            SELECT n, 0 AS g, $1::timestamptz + interval '10 days' AS t,
                   'SN' || (n * {GPUS}) AS old_serial, 'SNR' || n AS new_serial
            FROM generate_series(7, $3 - 1, 500) AS n
            UNION ALL
            SELECT n, 3, $1::timestamptz + interval '12 days', 'SN' || (n * {GPUS} + 3),
                   'SN' || ((n - 1) * {GPUS})
            FROM generate_series(8, $3 - 1, 500) AS n
        )
        INSERT INTO {tables.events} (record_id, kind, cluster, node, machine, observed_at,
                                     payload)
        SELECT md5('h/' || n || '/' || g || '/' || t || state), 'health', 'fleet',
               'node-' || lpad(n::text, 5, '0'), 'i-' || md5(n::text), t,
               jsonb_build_object('kind', 'health', 'cluster', 'fleet',
                   'node', 'node-' || lpad(n::text, 5, '0'), 'chassis', 'CH-' || (n / {RACK}),
                   'gpu', {_SERIAL}, 'uuid', 'GPU-' || md5({_SERIAL}), 'index', g,
                   'check', 'xid', 'state', state, 'previous_state', previous,
                   'action', action, 'reason', reason,
                   'read_time', to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))
        FROM health
        UNION ALL
        SELECT md5('x/' || n || '/' || g), 'hardware', 'fleet', 'node-' || lpad(n::text, 5, '0'),
               'i-' || md5(n::text), t,
               jsonb_build_object('kind', 'hardware', 'event', 'replaced', 'cluster', 'fleet',
                   'node', 'node-' || lpad(n::text, 5, '0'), 'chassis', 'CH-' || (n / {RACK}),
                   'gpu', new_serial, 'old_serial', old_serial, 'new_serial', new_serial,
                   'uuid', 'GPU-' || md5(new_serial),
                   'index', g,
                   'pci_bus_id', '0000000' || g || ':' || lpad(to_hex(n % 256), 2, '0') || ':00.0',
                   'read_time', to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'))
        FROM swaps
    """


def _bound(statement: str, fleet: Fleet, day: int = 0) -> str:
    """The statement with its parameters written in (numbers and times of our own making)."""
    since = START + timedelta(days=day)
    values = {
        "$1": f"'{START.isoformat()}'",
        "$2": f"'{fleet.end.isoformat()}'",
        "$3": str(fleet.nodes),
        "$4": str(fleet.days),
        "$5": f"'{since.isoformat()}'",
        "$6": f"'{(since + timedelta(days=1)).isoformat()}'",
    }
    for name, value in values.items():
        statement = statement.replace(name, value)
    return statement


async def generate(
    conn: asyncpg.Connection, tables: Tables, fleet: Fleet, raw_usage_days: int | None = None
) -> None:
    """The fleet's records, a day at a time (as they would have arrived), then ANALYZE.

    `raw_usage_days`: store the usage records of only the last so many days; the days before
    go straight into the usage rollup (the only thing that reads them there), which keeps a
    fleet-sized data set within a machine's disk: tens of millions of records of 1 kB."""
    raw_from = fleet.days - (fleet.days if raw_usage_days is None else raw_usage_days)
    for day in range(fleet.days):
        await conn.execute(_bound(_readings(tables), fleet, day))
        usage = _usage(tables) if day >= raw_from else _usage_summed(tables)
        await conn.execute(_bound(usage, fleet, day))
    await conn.execute(_bound(_allocations(tables), fleet))
    await conn.execute(_bound(_marks(tables), fleet))
    for table in (tables.readings, tables.allocations, tables.events):
        await conn.execute(f"VACUUM ANALYZE {table}")


async def create(cluster: PostgresCluster, tables: Tables, fleet: Fleet) -> None:
    """The exporter's tables (its own migration) in `cluster`, holding the fleet's records."""
    kwargs: Any = cluster.connect_kwargs()
    conn = await asyncpg.connect(**kwargs, command_timeout=None)
    try:
        async with conn.transaction():
            for statement in migration(tables):
                await conn.execute(statement)
        await generate(conn, tables, fleet, raw_usage_days=2)
    finally:
        await conn.close()
