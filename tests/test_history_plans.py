"""Every statement `history` runs on PostgreSQL reads through the index the exporter's
migration made for it (docs/history.md), on a generated fleet (`tests/history_fleet.py`, small
here; `nox -s bench` times the questions on 10,000 nodes x 30 days). EXPLAIN shows the plan
PostgreSQL chooses with the statistics of the data, as it would for a person asking."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.postgres.schema import Tables
from gpuid_agent.history.command import SETTINGS
from gpuid_agent.history.postgres_source import PostgresSource
from gpuid_agent.history.source import Where
from gpuid_agent.runtime.config_load import load_settings
from tests.history_fleet import START, Fleet, create, node_name
from tests.servers.postgres import PostgresCluster

FLEET = Fleet(nodes=60, days=8)


@pytest.fixture(scope="module")
def fleet_source(postgres_server: PostgresCluster) -> Iterator[PostgresSource]:
    schema = f"p_{uuid.uuid4().hex[:12]}"
    tables = Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")

    asyncio.run(create(postgres_server, tables, FLEET))
    env = {k.lower(): v for k, v in postgres_server.env().items()}
    source = PostgresSource(load_settings(env | {"postgres_table": tables.readings}, SETTINGS))
    try:
        yield source
    finally:
        source.close()


def indexes(source: PostgresSource, sql: str, args: list[Any]) -> set[str]:
    """The indexes the plan of `sql` reads."""

    async def explain(conn: asyncpg.Connection) -> Any:
        return await conn.fetchval(f"EXPLAIN (FORMAT JSON) {sql}", *args)

    plan = json.loads(source._run(explain))

    def walk(node: dict[str, Any]) -> Iterator[str]:
        if "Index Name" in node:
            yield node["Index Name"]
        for child in node.get("Plans", ()):
            yield from walk(child)

    return set(walk(plan[0]["Plan"]))


MIDDLE = START + timedelta(days=4, hours=12)
NODE = node_name(30)
LATE = FLEET.end - timedelta(hours=6)  # the usage records of the last days are stored as such


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("statement", "index"),
    [
        ("serial readings", "idx_gpu_readings_gpu"),
        ("node readings", "idx_gpu_readings_node_time"),
        ("serial allocations", "idx_gpu_allocations_gpu"),
        ("node allocations", "idx_gpu_allocations_node_started"),
        ("pod allocations", "idx_gpu_allocations_pod"),
        ("open allocations' usage", "idx_gpu_events_node_kind_time"),
        ("serial events", "idx_gpu_events_gpu"),
        ("replaced serial events", "idx_gpu_events_old_serial"),
        ("node events", "idx_gpu_events_node_kind_time"),
        ("usage", "idx_gpu_events_usage_totals"),
    ],
)
def test_each_statement_reads_its_index(
    fleet_source: PostgresSource, statement: str, index: str
) -> None:
    s = fleet_source
    serial = Where(serial="SN40")
    node = Where(node=NODE, since=MIDDLE - timedelta(days=1), until=MIDDLE)
    queries = {
        "serial readings": s.sightings_query(serial),
        "node readings": s.sightings_query(node),
        "serial allocations": s.holdings_query(serial),
        "node allocations": s.holdings_query(node),
        "pod allocations": s.holdings_query(Where(namespace="team-3", pod="job-30-9")),
        "open allocations' usage": s.so_far_query(NODE, MIDDLE, ["a", "b"]),
        "serial events": s.marks_query(serial),
        "replaced serial events": s.marks_query(serial),
        "node events": s.marks_query(node),
        "usage": s.usage_query(MIDDLE, MIDDLE + timedelta(hours=6), None),
    }
    assert index in indexes(s, *queries[statement])
