"""`gpuid-agent history`'s four questions, each asked of the three sources holding the same
records as the exporters stored them: a directory of JSON lines, the real PostgreSQL (through
the PostgreSQL exporter, its migration, indexes and usage rollup) and moto's S3 (through the
S3 exporter, read with DuckDB). Every source gives the same answer, and it is the known one."""

from __future__ import annotations

import asyncio
import uuid as uuids
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.history import questions
from gpuid_agent.history.command import SETTINGS
from gpuid_agent.history.records_dir import RecordsDirectory
from gpuid_agent.history.render_data import as_dict
from gpuid_agent.history.source import Source
from gpuid_agent.records.serialize import json_lines
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import NotFoundError
from tests.history_support import SLOTS, at, fleet
from tests.servers.postgres import PostgresCluster
from tests.servers.s3 import MotoServer


def _batches(records: list[AnyRecord], size: int = 25) -> Iterator[list[AnyRecord]]:
    for i in range(0, len(records), size):
        yield records[i : i + size]


def records_source(tmp_path: Path) -> Source:
    folder = tmp_path / "records"
    (folder / "node-a").mkdir(parents=True)
    records = fleet()
    half = len(records) // 2
    (folder / "node-a" / "agent.jsonl").write_bytes(json_lines(records[:half]))
    # a second file, with lines that are no record among the records
    (folder / "agent-2.jsonl").write_bytes(
        b'not json\n{"kind": "gossip"}\n\n' + json_lines(records[half:]) + b'{"msg": "a log"}\n'
    )
    return RecordsDirectory(str(folder))


def postgres_source(postgres: PostgresCluster) -> Source:
    from gpuid_agent.history.postgres_source import PostgresSource

    schema = f"h_{uuids.uuid4().hex[:12]}"
    kwargs: Any = postgres.connect_kwargs()
    exporter = PostgresExporter(
        **kwargs,
        sslmode="disable",
        tables=Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events"),
        timeout=10.0,
    )

    async def deliver() -> None:
        try:
            for batch in _batches(fleet()):
                await exporter.export(batch)
        finally:
            await exporter.close()

    asyncio.run(deliver())
    env = {k.lower(): v for k, v in postgres.env().items()}
    return PostgresSource(
        load_settings(env | {"postgres_table": f"{schema}.gpu_readings"}, SETTINGS)
    )


def s3_source(moto: MotoServer, bucket: str) -> Source:
    from gpuid_agent.delivery.exporters.s3 import S3Exporter
    from gpuid_agent.history.s3_source import S3Source

    exporter = S3Exporter(bucket, endpoint_url=moto.url, region="us-east-1", path_style=True)

    async def deliver() -> None:
        try:
            for batch in _batches(fleet()):
                await exporter.export(batch, BatchMeta.new())
        finally:
            await exporter.close()

    asyncio.run(deliver())
    settings = {"s3_bucket": bucket, "s3_endpoint_url": moto.url, "s3_path_style": True,
                "s3_region": "us-east-1"}  # fmt: skip
    return S3Source(load_settings(settings, SETTINGS))


@pytest.fixture(params=["records", "postgres", "s3"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Source]:
    if request.param == "records":
        made = records_source(tmp_path)
    elif request.param == "postgres":
        made = postgres_source(request.getfixturevalue("postgres"))
    else:
        pytest.importorskip("duckdb", reason="the S3 source reads through DuckDB (history-s3)")
        made = s3_source(request.getfixturevalue("moto_server"), request.getfixturevalue("s3_bucket"))
    try:
        yield made
    finally:
        made.close()


def answer(found: Any) -> dict[str, Any]:
    return as_dict(found, UTC)


def held(body: dict[str, Any]) -> list[tuple[Any, ...]]:
    return sorted(
        (a["namespace"], a["pod"], a["node"], a["slot"], a["serial"], a["started_at"],
         a["ended_at"], a["gpu_hours"], a["kwh"])
        for a in body["allocations"]
    )


def test_gpu_where_it_was_who_held_it_and_what_happened(source: Source) -> None:
    body = answer(questions.gpu(source, "SN-A"))
    stays = [(p["node"], p["chassis"], p["slots"], p["first_seen"], p["last_seen"])
             for p in body["placements"]]  # fmt: skip
    assert stays == [
        ("gpu-1", "CH-1", [SLOTS[0], SLOTS[1]], "2025-03-01T09:00:00.000Z",
         "2025-03-02T09:00:00.000Z"),
        ("gpu-2", "CH-2", [SLOTS[0], SLOTS[1]], "2025-03-03T09:00:00.000Z",
         "2025-03-03T21:00:00.000Z"),
    ]  # fmt: skip
    six = (6.0, 3.0)  # 6 GPU-hours at 500 W: 3 kWh
    assert held(body) == [
        ("ml", "train-0", "gpu-1", SLOTS[0], "SN-A", "2025-03-01T10:00:00.000Z",
         "2025-03-01T16:00:00.000Z", *six),
        ("ml", "train-0", "gpu-1", SLOTS[1], "SN-A", "2025-03-01T10:00:00.000Z",
         "2025-03-01T16:00:00.000Z", *six),
        ("ml", "train-1", "gpu-2", SLOTS[0], "SN-A", "2025-03-03T10:00:00.000Z",
         "2025-03-03T12:30:00.000Z", 2.5, 1.25),
    ]  # fmt: skip
    events = [(e["time"], e["kind"], e["node"], e["xid"], e["old_serial"]) for e in body["events"]]
    assert events == [
        ("2025-03-01T14:00:00.000Z", "xid", "gpu-1", 79, None),
        ("2025-03-03T08:00:00.000Z", "replaced", "gpu-1", None, "SN-A"),
        ("2025-03-03T09:00:00.000Z", "moved", "gpu-2", None, None),
    ]
    assert "moved from gpu-1" in body["events"][2]["what"]


def test_node_at_a_moment(source: Source) -> None:
    body = answer(questions.node(source, ["gpu-1"], at=at(1, 13)))
    gpus = [(p["serial"], p["chassis"], p["slots"]) for p in body["placements"]]
    assert gpus == [("SN-A", "CH-1", [SLOTS[0], SLOTS[1]]), ("SN-B", "CH-1", [SLOTS[2], SLOTS[3]])]
    pods = sorted((a["namespace"], a["pod"], a["serial"], a["slot"]) for a in body["allocations"])
    assert pods == [
        ("inf", "serve-0", "SN-B", SLOTS[2]),
        ("ml", "train-0", "SN-A", SLOTS[0]),
        ("ml", "train-0", "SN-A", SLOTS[1]),
    ]
    later = answer(questions.node(source, ["gpu-1"], at=at(3, 10)))
    assert [p["serial"] for p in later["placements"]] == ["SN-D", "SN-B"]
    # serve-0 is still open: its GPU-hours are its usage records' so far (day 1, 12:00-24:00)
    [serve] = later["allocations"]
    assert (serve["pod"], serve["ended_at"], serve["gpu_hours"]) == ("serve-0", None, 12.0)


def test_node_over_a_range(source: Source) -> None:
    body = answer(questions.node(source, ["gpu-1", "gpu-2"], since=at(3, 0), until=at(4, 0)))
    gpus = sorted((p["node"], p["serial"]) for p in body["placements"])
    assert gpus == [("gpu-1", "SN-B"), ("gpu-1", "SN-D"), ("gpu-2", "SN-A"), ("gpu-2", "SN-C")]
    pods = sorted((a["node"], a["pod"]) for a in body["allocations"])
    assert pods == [("gpu-1", "serve-0"), ("gpu-2", "train-1")]
    assert [e["kind"] for e in body["events"]] == ["replaced"]


def test_pod_the_physical_gpus_it_held(source: Source) -> None:
    body = answer(questions.pod(source, "ml", "train-0"))
    assert [(a["serial"], a["slot"], a["chassis"], a["gpu_hours"]) for a in body["allocations"]] == [
        ("SN-A", SLOTS[0], "CH-1", 6.0),
        ("SN-A", SLOTS[1], "CH-1", 6.0),
    ]
    # the XID that hit its GPU while it held it
    assert [(e["kind"], e["xid"]) for e in body["events"]] == [("xid", 79)]


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        # day 1: train-0 12 GPU-hours, serve-0 12 (12:00-24:00), one idle hour of SN-B
        ("namespace", [(("inf",), 12.0, 6.0), (("ml",), 12.0, 6.0), (("",), 1.0, 0.5)]),
        ("workload", [(("inf", "Job/serve"), 12.0, 6.0), (("ml", "Job/train"), 12.0, 6.0),
                      (("", ""), 1.0, 0.5)]),
        ("team", [(("(no team)",), 12.0, 6.0), (("serving",), 12.0, 6.0), (("",), 1.0, 0.5)]),
    ],
)  # fmt: skip
def test_usage_adds_up_the_usage_records(source: Source, by: Any, expected: list[Any]) -> None:
    found = questions.usage(source, by, at(1, 0), at(2, 0), teams={"inf": "serving"})
    rows = [(r.group, round(r.gpu_hours, 3), round(r.kwh, 3)) for r in found.usage]
    assert rows == expected


def test_usage_by_the_hour_at_both_ends(source: Source) -> None:
    """Hours inside a day: 13:00-15:00 of day 1 and day 3 10:00-12:00 (whole UTC hours)."""
    found = questions.usage(source, "namespace", at(1, 13), at(1, 15))
    assert [(r.group, r.gpu_hours) for r in found.usage] == [(("ml",), 4.0), (("inf",), 2.0)]
    found = questions.usage(source, "namespace", at(1, 23), at(3, 12))
    assert [(r.group, r.gpu_hours) for r in found.usage] == [(("ml",), 2.0), (("inf",), 1.0)]


def test_not_found_says_what(source: Source) -> None:
    with pytest.raises(NotFoundError, match="GPU serial SN-Z"):
        questions.gpu(source, "SN-Z")
    with pytest.raises(NotFoundError, match="node gpu-9"):
        questions.node(source, ["gpu-9"], at=at(1, 12))
    with pytest.raises(NotFoundError, match="pod ml/nobody"):
        questions.pod(source, "ml", "nobody")
    with pytest.raises(NotFoundError, match="no usage records"):
        questions.usage(source, "namespace", datetime(2024, 1, 1, tzinfo=UTC),
                        datetime(2024, 1, 2, tzinfo=UTC))  # fmt: skip


def test_a_directory_counts_the_lines_that_are_no_record(tmp_path: Path) -> None:
    source = records_source(tmp_path)
    questions.gpu(source, "SN-A")
    assert isinstance(source, RecordsDirectory)
    assert source.skipped == 3  # `not json`, the unknown kind, the log line
    assert source.first_skipped.endswith("agent-2.jsonl:1")
