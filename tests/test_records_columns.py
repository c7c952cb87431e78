"""The column registry is what the docs, the PostgreSQL DDL and the S3 CSV header say."""

from __future__ import annotations

import re
from pathlib import Path

from gpuid_agent.delivery.exporters.postgres import Tables, schema
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.s3 import to_csv
from gpuid_agent.records import columns
from gpuid_agent.records.serialize import to_wire
from gpuid_agent.records.types import ReadingRecord
from tests.exporter_support import readings

DOCS = Path(__file__).resolve().parents[1] / "docs" / "exporters"
BLOCK = re.compile(r"<!-- columns: ([a-z]+) -->\n(.*?)<!-- /columns -->", re.S)


def blocks(doc: str) -> dict[str, str]:
    return dict(BLOCK.findall((DOCS / doc).read_text()))


def test_postgres_doc_tables_are_the_registry() -> None:
    found = blocks("postgres.md")
    assert found["readings"] == columns.markdown(columns.READINGS)
    assert found["allocations"] == columns.markdown(columns.ALLOCATIONS)


def test_s3_doc_header_is_the_csv_header() -> None:
    header = to_csv([to_wire(r) for r in readings(1)], header=True).decode().splitlines()[0]
    assert blocks("s3.md")["csv"] == f"```\n{header}\n```\n"
    assert header.split(",") == list(columns.CSV_COLUMNS)


def test_every_reading_column_comes_from_a_record_field() -> None:
    fields = set(ReadingRecord.__slots__) | {"record_id"}
    for column in columns.READINGS:
        assert column.name == "attributes" or column.source in fields, column.name
    assert tuple(c.name for c in columns.READINGS) == rowmap.READING_COLUMNS
    assert tuple(c.name for c in columns.ALLOCATIONS) == rowmap.ALLOCATION_COLUMNS


def test_ddl_declares_every_registry_column() -> None:
    ddl = "\n".join(schema.migration(Tables.named("r", "a", "e")))
    for column in columns.READINGS:
        assert f"{column.name} {column.sql}" in ddl, column.name
    for table, registry in zip(
        schema.STAGING[:2], (columns.READINGS, columns.ALLOCATIONS), strict=True
    ):
        assert [c.name for c in registry] == re.findall(r"(\w+) [A-Z]+(?:\[\])?(?:,|\))", table)
