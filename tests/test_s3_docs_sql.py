"""The SQL in docs/exporters/s3.md says what the exporter writes, Athena/Trino statements are
well-formed in their dialects, and duckdb (which runs the DuckDB ones) stays out of the agent."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import sqlglot

from gpuid_agent.delivery.exporters.s3 import CSV_COLUMNS
from tests.test_s3_queries import EXPECTED, doc_sql

ROOT = Path(__file__).resolve().parents[1]


def _declared_columns(sql: str) -> list[str]:
    inner = sql.split("columns = {", 1)[1].split("}", 1)[0]
    return re.findall(r"'([a-z_]+)': '[A-Z]+'", inner)


def test_documented_table_columns_are_the_csv_columns() -> None:
    sql = doc_sql()
    assert _declared_columns(sql[("duckdb", "tables")]) == list(CSV_COLUMNS)
    athena = sql[("athena", "tables")].split("PARTITIONED BY", 1)[0]
    assert re.findall(r"`([a-z_]+)` string", athena) == list(CSV_COLUMNS)


def test_athena_and_trino_statements_parse_in_their_dialects() -> None:
    sql = doc_sql()
    statements = [s for s in sql[("athena", "tables")].split(";") if s.strip()]
    assert len(statements) == 4
    for statement in statements:
        sqlglot.parse_one(statement, read="athena")  # raises on a syntax error
    for (engine, name), query in sql.items():
        if engine == "query":  # the one documented difference: sequence for generate_series
            sqlglot.parse_one(query.replace("generate_series", "sequence"), read="trino")
            assert name in EXPECTED


def test_every_documented_query_is_checked() -> None:
    # each DuckDB block is run by a test: the tables and NDJSON readings in
    # test_s3_queries, the older objects in test_s3_previous_layout
    duck = {name for engine, name in doc_sql() if engine == "duckdb"}
    assert duck == {"tables", "readings-ndjson", "health", "previous-layout", "gpuid-objects"}
    names = {name for engine, name in doc_sql() if engine == "query"}
    assert names == set(EXPECTED)


def test_duckdb_is_only_an_optional_dependency() -> None:
    """The agent never needs DuckDB: `history` reads S3 with it, installed as an extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.lower().startswith("duckdb") for d in project["dependencies"])
    for extra in ("test", "history-s3"):
        assert any(d.lower().startswith("duckdb") for d in project["optional-dependencies"][extra])
    for path in (ROOT / "gpuid_agent").rglob("*.py"):
        if path == ROOT / "gpuid_agent" / "history" / "s3_source.py":
            continue  # imports it when S3 is read, and says how to install it if missing
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.split(".")[0] == "duckdb" for n in names), path
    # and importing every module of the package, the S3 exporter's included, loads none
    script = (
        "import importlib, pkgutil, sys, gpuid_agent\n"
        "for m in pkgutil.walk_packages(gpuid_agent.__path__, 'gpuid_agent.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "print('duckdb' in sys.modules, 'gpuid_agent.delivery.exporters.s3.layout' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.split() == ["False", "True"]
