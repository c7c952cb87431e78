"""docs/migration.md is true where the code can say: the variables table against the
settings' real defaults, the metrics table against the agent's registry, and gpuid's
constraint name against a real PostgreSQL server."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from gpuid_agent.docs import describe_default, own_metrics_rows
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.config_checks import UNUSED_GPUID_SETTINGS
from tests.servers.postgres import PostgresCluster

PAGE = Path(__file__).resolve().parents[1] / "docs" / "migration.md"
PG_NAME_MAX = 63  # NAMEDATALEN - 1


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _table(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip().strip("|").split(" | ")] for row in rows]
    return cells[2:]  # past the header and the --- line


def _unquote(cell: str) -> str:
    return cell.strip("`")


def _normal(default: str) -> str:
    return default.replace("`", "").strip()


def test_variables_table_states_the_real_defaults_and_every_difference() -> None:
    rows = _table(_section("Environment variables"))
    assert len(rows) >= 20
    seen = set()
    for variable, gpuid_default, ours, notes in rows:
        name = _unquote(variable).lower()
        assert name in Settings.model_fields, f"{variable} is no setting of the agent"
        seen.add(name)
        real = describe_default(Settings.model_fields[name])
        assert ours == real, f"{variable}: the page says {ours}, the agent's default is {real}"
        differs = _normal(gpuid_default) != _normal(ours)
        assert ("**differs**" in notes) == differs, f"{variable}: {gpuid_default} vs {ours}"
    # every gpuid variable the agent accepts without using it is in the table, said so
    for name in UNUSED_GPUID_SETTINGS:
        assert name in seen
        (notes,) = [r[3] for r in rows if _unquote(r[0]).lower() == name]
        assert "not used" in notes and "logged" in notes


def _declared_metrics() -> dict[str, set[str]]:
    """Series name → label names, as the metrics reference's generator reads them."""
    declared: dict[str, set[str]] = {}
    for row in own_metrics_rows():
        series, _kind, labels, _doc = _table("| h |\n| - |\n" + row)[0]
        declared[_unquote(series)] = set(re.findall(r"`(\w+)`", labels))
    return declared


def test_metrics_table_names_the_agents_series_and_labels() -> None:
    declared = _declared_metrics()
    rows = _table(_section("Metrics"))
    assert len(rows) >= 5
    for _gpuid, ours in rows:
        match = re.match(r"`(\w+)(?:\{([\w,]*)\})?`", ours)
        assert match, ours
        name, labels = match.group(1), match.group(2)
        assert name in declared, f"{name} is not one of the agent's metrics"
        assert declared[name] == set(labels.split(",") if labels else []), name


def test_no_identifier_on_the_page_is_longer_than_postgres_allows() -> None:
    text = PAGE.read_text()
    for word in re.findall(r"`([a-z_][a-z0-9_]*_key)`", text):
        assert len(word) <= PG_NAME_MAX, word


@pytest.fixture
async def db(postgres: PostgresCluster, pg_schema: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    await conn.execute(f"CREATE SCHEMA {pg_schema}; SET search_path TO {pg_schema}")
    try:
        yield conn
    finally:
        await conn.execute(f"DROP SCHEMA {pg_schema} CASCADE")
        await conn.close()


async def test_gpuid_constraint_name_is_what_postgres_gives(db: asyncpg.Connection) -> None:
    section = _section("PostgreSQL: gpuid's table")
    (stated,) = re.findall(r"`(gpu_[a-z_]+_key)`", section)
    assert len(stated) <= PG_NAME_MAX
    # gpuid's table as its auto-migration creates it, under its default name
    await db.execute(
        """CREATE TABLE gpu (
            id BIGSERIAL PRIMARY KEY,
            cluster VARCHAR(255) NOT NULL, node VARCHAR(255) NOT NULL,
            machine VARCHAR(255) NOT NULL, source VARCHAR(255) NOT NULL,
            chassis VARCHAR(255) NOT NULL, gpu VARCHAR(255) NOT NULL,
            read_time TIMESTAMP WITH TIME ZONE NOT NULL,
            created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT NOW(),
            UNIQUE(cluster, node, machine, source, chassis, gpu, read_time))"""
    )
    (query,) = re.findall(r"```sql\n(.*?)```", section, re.S)
    found = [r["conname"] for r in await db.fetch(query)]
    assert found == [stated]
