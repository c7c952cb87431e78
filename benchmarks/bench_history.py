"""`gpuid-agent history` on a fleet's month in PostgreSQL: 10,000 nodes x 30 days.

The data set is generated inside PostgreSQL (`tests/history_fleet.py`: four GPUs a node, an
hourly heartbeat reading per GPU, pods in six-hour slots, their usage records, XIDs and
replacements) in the tables the exporter's migration makes, indexes and usage rollup
included; the usage records of the last two days are stored as records, the 28 before go
straight into the rollup, which is all that reads them (a month of them as records would be
about 30 GB). Each question is then asked as `history` asks it — the PostgreSQL source and the
question, end to end — first right after a server restart (its cache empty; the machine's
page cache is not), then five times more (median). `GPUID_BENCH_HISTORY_NODES` sets the fleet
(`GPUID_BENCH_QUICK=1`: 1,000 nodes).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from datetime import UTC, timedelta
from typing import Any

import asyncpg

from benchmarks.common import Row
from gpuid_agent.delivery.exporters.postgres.schema import Tables
from gpuid_agent.history import questions
from gpuid_agent.history.answers import Answer
from gpuid_agent.history.command import SETTINGS
from gpuid_agent.history.postgres_source import PostgresSource
from gpuid_agent.history.render_html import to_html
from gpuid_agent.runtime.config_load import load_settings
from tests.history_fleet import RACK, START, Fleet, create, node_name
from tests.servers.postgres import PostgresCluster

DAYS = 30
RUNS = 5
GROUP = "history"


def _nodes() -> int:
    if "GPUID_BENCH_HISTORY_NODES" in os.environ:
        return int(os.environ["GPUID_BENCH_HISTORY_NODES"])
    return 1_000 if os.environ.get("GPUID_BENCH_QUICK") else 10_000


async def _build(cluster: PostgresCluster, tables: Tables, fleet: Fleet) -> list[Row]:
    started = time.perf_counter()
    await create(cluster, tables, fleet)
    took = time.perf_counter() - started
    kwargs: Any = cluster.connect_kwargs()
    conn = await asyncpg.connect(**kwargs)
    try:
        rows = [Row(GROUP, "data set generated", took, "s", f"{fleet.nodes:,} nodes x {DAYS} d")]
        for table in (tables.readings, tables.allocations, tables.events, tables.events + "_usage"):
            count = await conn.fetchval(f"SELECT count(*) FROM {table}")
            size = await conn.fetchval(f"SELECT pg_total_relation_size('{table}')")
            rows.append(Row(GROUP, f"rows: {table.split('.')[-1]}", count, "rows",
                            f"{size / 2**30:.1f} GiB with indexes"))  # fmt: skip
        return rows
    finally:
        await conn.close()


def _timed(ask: Callable[[], Answer]) -> tuple[float, Answer]:
    started = time.perf_counter()
    found = ask()
    return time.perf_counter() - started, found


def _questions(source: PostgresSource, fleet: Fleet) -> list[tuple[str, Callable[[], Answer]]]:
    middle = START + timedelta(days=DAYS // 2, hours=12, minutes=30)
    rack = [node_name(n) for n in range(RACK)]
    end = fleet.end
    pod = f"job-{fleet.nodes // 2}-{DAYS * 2}"
    namespace = _namespace(source, pod)
    return [
        ("gpu: a GPU that moved (30 d)", lambda: questions.gpu(source, "SN28")),
        ("gpu: a GPU that stayed (30 d)", lambda: questions.gpu(source, f"SN{fleet.nodes * 2}")),
        ("node at a moment", lambda: questions.node(source, [node_name(fleet.nodes // 2)],
                                                    at=middle)),
        ("node over 30 d", lambda: questions.node(source, [node_name(fleet.nodes // 3)],
                                                  since=START, until=end)),
        ("18 nodes (72 GPUs) over 30 d", lambda: questions.node(source, rack, since=START,
                                                                until=end)),
        ("pod (4 GPUs)", lambda: questions.pod(source, namespace, pod)),
        ("usage by namespace, 30 d", lambda: questions.usage(source, "namespace", START, end)),
        ("usage by workload, 30 d", lambda: questions.usage(source, "workload", START, end)),
        ("usage by namespace, hours at both ends", lambda: questions.usage(
            source, "namespace", START + timedelta(hours=30), end - timedelta(hours=30))),
    ]  # fmt: skip


def _namespace(source: PostgresSource, pod: str) -> str:
    """The generated pod's namespace, as a person would look it up."""

    async def ask(conn: asyncpg.Connection) -> str:
        return str(
            await conn.fetchval(f"SELECT namespace FROM {source.allocations} WHERE pod = $1", pod)
        )

    return source._run(ask)


def _settings(cluster: PostgresCluster, tables: Tables) -> Any:
    env = {k.lower(): v for k, v in cluster.env().items()}
    return load_settings(env | {"postgres_table": tables.readings}, SETTINGS)


def _ask(cluster: PostgresCluster, tables: Tables, fleet: Fleet) -> list[Row]:
    rows = []
    settings = _settings(cluster, tables)
    cluster.stop_server()
    cluster.start_server()
    first: dict[str, float] = {}
    answers: dict[str, Answer] = {}
    source = PostgresSource(settings)
    try:
        asked = _questions(source, fleet)
        for name, ask in asked:
            first[name], answers[name] = _timed(ask)
        for name, ask in asked:
            times = [_timed(ask)[0] for _ in range(RUNS)]
            found = answers[name]
            what = (f"{len(found.placements)} stays, {len(found.holdings)} allocations, "
                    f"{len(found.marks)} events" if found.question != "usage"
                    else f"{len(found.usage)} groups")  # fmt: skip
            rows.append(Row(GROUP, f"{name}: first after restart", first[name], "s", what))
            rows.append(Row(GROUP, f"{name}: median of {RUNS}", statistics.median(times), "s"))
        started = time.perf_counter()
        page = to_html(answers["18 nodes (72 GPUs) over 30 d"], UTC)
        took = time.perf_counter() - started
        rows.append(Row(GROUP, "html page of 72 GPUs x 30 d", took, "s",
                        f"{len(page) / 2**20:.1f} MiB"))  # fmt: skip
    finally:
        source.close()
    return rows


async def run() -> list[Row]:
    reason = PostgresCluster.unavailable()
    if reason:
        return [Row(GROUP, "skipped", 0, "", reason)]
    fleet = Fleet(_nodes(), DAYS)
    cluster = PostgresCluster()
    cluster.start()
    try:
        tables = Tables.named("fleet.gpu_readings", "gpu_allocations", "gpu_events")
        rows = await _build(cluster, tables, fleet)
        rows += await asyncio.to_thread(_ask, cluster, tables, fleet)
        return rows
    finally:
        cluster.close()
