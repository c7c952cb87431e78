"""The PostgreSQL exporter's stored form (COPY text) and backlogs drained in coalesced COPYs,
against a real server."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.base import BatchMeta, StoredForm
from gpuid_agent.delivery.exporters.postgres import (
    COALESCE_RECORDS,
    PostgresExporter,
    Tables,
    stored_payload,
)
from gpuid_agent.delivery.exporters.postgres import rows as rowmap
from gpuid_agent.delivery.exporters.postgres.copytext import Payload, line
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import REJECTED_DIR, DiskSpool
from gpuid_agent.runtime.errors import CorruptBatchError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import allocation, health, readings, spool_files, wire_id
from tests.servers.postgres import PostgresCluster
from tests.waiting import eventually

Factory = Callable[..., PostgresExporter]


def tables(schema: str) -> Tables:
    return Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events")


@pytest.fixture
async def make(postgres: PostgresCluster, pg_schema: str) -> AsyncIterator[Factory]:
    made: list[PostgresExporter] = []

    def factory(**overrides: Any) -> PostgresExporter:
        kw: dict[str, Any] = {
            **postgres.connect_kwargs(),
            "sslmode": "disable",
            "tables": tables(pg_schema),
            "timeout": 20.0,
        }
        kw.update(overrides)
        exporter = PostgresExporter(**kw)
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


async def drain(exporter: PostgresExporter, spool: DiskSpool, metrics: AgentMetrics) -> None:
    worker = ExporterWorker(
        exporter, BatchPolicy(batch_size=10, flush_interval=0.01), metrics, store=spool
    )
    task = asyncio.create_task(worker.run())
    await eventually(lambda: spool.batches == 0, within=60)
    worker.close_intake()
    await asyncio.wait_for(task, 20)


def deliveries(metrics: AgentMetrics) -> float:
    return metrics.export_success.labels("postgres")._value.get()


# ---- the COPY text form ------------------------------------------------------------------------

hostile_text = st.text(
    alphabet=st.characters(codec=None, min_codepoint=0, max_codepoint=0x10FFFF), max_size=80
)
copy_sensitive = st.text(alphabet="\\\t\n\r\x00N{}\",' aé\ud800", max_size=30)
text_value = st.one_of(st.none(), hostile_text, copy_sensitive)


# What a record id can hash (reading and health ids hash their content as JSON, which has no
# lone surrogate); allocations carry their ids, so anything goes there.
hashable_text = st.text(
    alphabet=st.characters(codec="utf-8", min_codepoint=0, max_codepoint=0x10FFFF), max_size=80
)
hashable_sensitive = st.text(alphabet="\\\t\n\r\x00N{}\",' aé", max_size=30)
hashable_value = st.one_of(hashable_text, hashable_sensitive)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "cluster": hashable_value,
            "node": hashable_value,
            "gpu": hashable_value,
            "model": st.one_of(st.none(), hashable_value),
            "change": hashable_value,
            "index": st.integers(),
            "mig_devices": st.lists(hashable_value, max_size=3).map(tuple),
        },
    ),
    st.one_of(copy_sensitive, hostile_text),
)
async def test_copy_text_stores_what_binary_copy_stores(
    make: Factory, db: asyncpg.Connection, pg_schema: str, fields: dict[str, Any], pod: str
) -> None:
    """Hostile values (escapes, tabs, newlines, NUL, lone surrogates, array and NULL markers)
    land exactly as a binary COPY of the same mapped rows lands them."""
    reading = replace(readings(1)[0], **fields)
    alloc = replace(allocation(pod="p"), pod=pod, namespace=pod[:20])
    records = [reading, alloc, health(node=pod.encode("utf-8", "replace").decode())]
    exporter = make()
    try:
        await exporter.export(records)
        await exporter.export(records)  # a re-send stores nothing twice
    finally:
        await exporter.close()
    rows = rowmap.split(records)
    await db.execute(
        f"CREATE TEMP TABLE binary_readings (LIKE {pg_schema}.gpu_readings INCLUDING DEFAULTS)"
    )
    try:
        columns = rowmap.READING_COLUMNS
        await db.copy_records_to_table("binary_readings", records=rows.readings, columns=columns)
        select = ", ".join(columns)
        via_text = await db.fetch(f"SELECT {select} FROM {pg_schema}.gpu_readings")
        via_binary = await db.fetch(f"SELECT {select} FROM binary_readings")
        assert [tuple(r) for r in via_text] == [tuple(r) for r in via_binary]
    finally:
        await db.execute("DROP TABLE binary_readings")
        await db.execute(f"TRUNCATE {pg_schema}.gpu_readings")
    stored = await db.fetchrow(
        f"SELECT pod, namespace FROM {pg_schema}.gpu_allocations WHERE allocation_id = $1",
        rows.allocations[0][0],
    )
    assert (stored["pod"], stored["namespace"]) == (rows.allocations[0][9], rows.allocations[0][8])
    assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_events") == 1
    await db.execute(f"TRUNCATE {pg_schema}.gpu_allocations, {pg_schema}.gpu_events")


@given(st.lists(st.one_of(st.none(), copy_sensitive, st.integers()), min_size=1, max_size=6))
def test_a_copy_line_has_one_field_per_value_and_no_raw_newline(row: list[Any]) -> None:
    text = line(row)
    assert "\n" not in text and "\r" not in text
    assert text.count("\t") == len(row) - 1
    assert text.split("\t").count("\\N") == sum(1 for v in row if v is None)


@given(st.binary(max_size=300))
def test_a_corrupt_payload_is_refused_not_guessed(data: bytes) -> None:
    good = stored_payload(readings(1))
    for candidate in (data, good[: len(data) % len(good)], good + data if data else b""):
        if candidate == good or not candidate:
            continue
        try:
            payload = Payload.decode(candidate)
        except CorruptBatchError:
            continue
        # Only a well-formed payload decodes: its sections hold the rows they declare.
        assert payload.readings.count(b"\n") == payload.counts[0]


# ---- draining a spooled backlog ------------------------------------------------------------------


async def test_a_backlog_of_small_batches_drains_in_few_copies(
    make: Factory, db: asyncpg.Connection, pg_schema: str, tmp_path: Path
) -> None:
    exporter = make()
    assert exporter.stored_form is not None
    spool = DiskSpool(tmp_path / "postgres", 1 << 30, form=exporter.stored_form)
    records = readings(300, step=timedelta(seconds=1)) + [allocation(pod=f"p{i}") for i in range(5)]
    for i in range(0, len(records), 10):
        await spool.add(records[i : i + 10])
    assert {p.suffix for p in spool_files(spool.directory)} == {".pgcopy"}
    metrics = AgentMetrics()
    await drain(exporter, spool, metrics)
    assert deliveries(metrics) == 1  # 121 spooled batches, one transaction
    assert metrics.exported_records.labels("postgres")._value.get() == len(records)
    assert (
        await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {pg_schema}.gpu_readings") == 1200
    )
    assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_readings") == 1200
    assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_allocations") == 5
    assert not spool_files(spool.directory)


async def test_coalescing_stops_at_its_bound(tmp_path: Path) -> None:
    from gpuid_agent.delivery.store import coalesce

    form = StoredForm("pgcopy", stored_payload, max_records=25, max_bytes=1 << 30)
    spool = DiskSpool(tmp_path, 1 << 30, form=form)
    for _ in range(6):
        await spool.add(readings(2))  # 8 records each
    first = spool.oldest()
    assert first is not None
    assert [b.count for b in coalesce(spool, first, form)] == [8, 8, 8]
    assert COALESCE_RECORDS >= 10_000  # a real backlog's deliveries are large


async def test_resent_and_repeated_records_in_a_coalesced_delivery_are_stored_once(
    make: Factory, db: asyncpg.Connection, pg_schema: str, tmp_path: Path
) -> None:
    """A crash after the commit but before the unlink re-sends batches already stored; the
    same batch may even be spooled twice. Each record is stored once."""
    exporter = make()
    assert exporter.stored_form is not None
    first, second = readings(3), readings(3, node="n2")
    await exporter.export(first[:5])  # part of the backlog got through before the crash
    spool = DiskSpool(tmp_path / "postgres", 1 << 30, form=exporter.stored_form)
    for batch in (first, second, first):
        await spool.add(batch)
    metrics = AgentMetrics()
    await drain(exporter, spool, metrics)
    assert deliveries(metrics) == 1
    expected = {wire_id(r) for r in first + second}
    stored = await db.fetch(f"SELECT record_id FROM {pg_schema}.gpu_readings")
    assert sorted(r[0] for r in stored) == sorted(expected)


async def test_a_corrupt_file_is_set_aside_and_the_rest_delivered(
    make: Factory, db: asyncpg.Connection, pg_schema: str, tmp_path: Path
) -> None:
    exporter = make()
    assert exporter.stored_form is not None
    spool = DiskSpool(tmp_path / "postgres", 1 << 30, form=exporter.stored_form)
    for i in range(3):
        await spool.add(readings(1, node=f"n{i}"))
    victim = spool_files(spool.directory)[1]
    victim.write_bytes(victim.read_bytes()[:-7])  # a torn file
    metrics = AgentMetrics()
    await drain(exporter, spool, metrics)
    assert await db.fetchval(f"SELECT count(DISTINCT node) FROM {pg_schema}.gpu_readings") == 2
    assert [p.name for p in spool_files(spool.directory / REJECTED_DIR)] == [victim.name]
    assert metrics.set_aside_batches.labels("postgres")._value.get() == 1


async def test_json_lines_left_by_an_older_agent_still_drain(
    make: Factory, db: asyncpg.Connection, pg_schema: str, tmp_path: Path
) -> None:
    old = DiskSpool(tmp_path / "postgres", 1 << 30)  # no stored form: JSON lines
    await old.add(readings(1, node="old"))
    exporter = make()
    assert exporter.stored_form is not None
    spool = DiskSpool(tmp_path / "postgres", 1 << 30, form=exporter.stored_form)
    await spool.add(readings(1, node="new"))
    assert sorted(p.suffix for p in spool_files(spool.directory)) == [".ndjson", ".pgcopy"]
    await drain(exporter, spool, AgentMetrics())
    nodes = await db.fetch(f"SELECT DISTINCT node FROM {pg_schema}.gpu_readings ORDER BY 1")
    assert [r[0] for r in nodes] == ["new", "old"]


async def test_an_encoder_failure_spools_json_lines_instead(tmp_path: Path) -> None:
    def broken(records: list[dict[str, Any]]) -> bytes:
        raise RuntimeError("encoder bug")

    spool = DiskSpool(tmp_path, 1 << 30, form=StoredForm("pgcopy", broken, 100, 1 << 20))
    await spool.add(readings(1))
    [path] = spool_files(tmp_path)
    assert path.suffix == ".ndjson"
    first = spool.oldest()
    assert first is not None
    assert len(await spool.load(first)) == 4


async def test_export_stored_refuses_a_foreign_payload(make: Factory) -> None:
    from gpuid_agent.runtime.errors import ExportError

    with pytest.raises(ExportError) as info:
        await make().export_stored([b'{"kind": "reading"}\n'], BatchMeta.new())
    assert not info.value.retryable
    assert info.value.error_type == "data"


def test_payloads_join_section_by_section() -> None:
    a = Payload.decode(stored_payload([*readings(1), allocation(pod="a")]))
    b = Payload.decode(stored_payload(readings(2, node="b")))
    joined = Payload.join([a, b])
    assert joined.counts == (12, 1, 0)
    assert Payload.decode(joined.encode()) == joined
    assert io.BytesIO(joined.readings).read().count(b"\n") == 12


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=2, max_size=6))
def test_joining_stored_batches_equals_joining_decoded_ones(shape: list[tuple[int, int]]) -> None:
    encoded = [
        stored_payload(readings(n, node=f"n{i}") + [allocation(pod=f"p{i}-{j}") for j in range(a)])
        for i, (n, a) in enumerate(shape)
    ]
    assert Payload.join_encoded(encoded) == Payload.join([Payload.decode(e) for e in encoded])


@given(st.integers(0, 10_000), st.binary(min_size=1, max_size=3))
def test_joining_refuses_a_damaged_batch(at: int, junk: bytes) -> None:
    good = [stored_payload(readings(1, node=f"n{i}")) for i in range(3)]
    victim = good[1]
    cut = at % len(victim)
    for damaged in (victim[:cut], victim[:cut] + junk + victim[cut + len(junk) :]):
        if damaged == victim:
            continue
        try:
            joined = Payload.join_encoded([good[0], damaged, good[2]])
        except CorruptBatchError:
            continue
        # Only damage that leaves a well-formed payload gets through, rows intact.
        assert joined.readings.count(b"\n") == joined.counts[0]


async def test_batches_held_in_memory_drain_joined_too(
    make: Factory, db: asyncpg.Connection, pg_schema: str
) -> None:
    """Without a spool the batches wait in memory as records; a backlog of them is joined
    into one delivery as well."""
    from gpuid_agent.delivery.store import MemoryBatches

    store = MemoryBatches(10_000)
    records = readings(100, step=timedelta(seconds=1))
    for i in range(0, len(records), 10):
        await store.add(records[i : i + 10])
    metrics = AgentMetrics()
    worker = ExporterWorker(
        make(), BatchPolicy(batch_size=10, flush_interval=0.01), metrics, store=store
    )
    task = asyncio.create_task(worker.run())
    await eventually(lambda: store.batches == 0, within=30)
    worker.close_intake()
    await asyncio.wait_for(task, 20)
    assert deliveries(metrics) == 1  # 40 held batches, one transaction
    assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_readings") == 400
