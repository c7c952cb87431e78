"""S3 exporter against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import csv
import gzip
import io
import json
import re
import urllib.parse
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.s3 import (
    CSV_COLUMNS,
    Layout,
    S3Exporter,
    hive_value,
    key_part,
    partition,
    to_csv,
)
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.errors import ExportError
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import allocation, health, readings, wire_id
from tests.record_strategies import RECORDS
from tests.servers.s3 import MotoServer
from tests.waiting import eventually

Factory = Callable[..., S3Exporter]
KEY = re.compile(
    r"^gpuid/(?P<kind>reading|allocation|health)/year=\d{4}/month=\d\d/day=\d\d/hour=\d\d/"
    r"cluster=[^/]*/node=[^/]*/\d{8}T\d{6}\.\d{3}Z-[0-9a-f]{32}\.(?P<ext>csv|ndjson)(\.gz)?$"
)


@pytest.fixture
async def make(moto_server: MotoServer, s3_bucket: str) -> AsyncIterator[Factory]:
    made: list[S3Exporter] = []

    def factory(**kw: Any) -> S3Exporter:
        bucket = kw.pop("bucket", s3_bucket)
        kw.setdefault("endpoint_url", moto_server.url)
        kw.setdefault("region", "us-east-1")
        kw.setdefault("path_style", True)
        kw.setdefault("timeout", 5.0)
        exporter = S3Exporter(bucket, **kw)
        made.append(exporter)
        return exporter

    yield factory
    for exporter in made:
        await exporter.close()


def objects(moto: MotoServer, bucket: str) -> dict[str, tuple[bytes, dict[str, str]]]:
    client: Any = moto.client()
    try:
        out = {}
        for item in client.list_objects_v2(Bucket=bucket).get("Contents", []):
            got = client.get_object(Bucket=bucket, Key=item["Key"])
            out[item["Key"]] = (got["Body"].read(), got["Metadata"])
        return out
    finally:
        client.close()


async def test_csv_object_with_gpuid_columns(
    make: Factory, moto_server: MotoServer, s3_bucket: str
) -> None:
    batch = readings(2)
    meta = BatchMeta.new()
    await make(csv_header=True).export(batch, meta)
    stored = objects(moto_server, s3_bucket)
    (key,) = stored
    match = KEY.match(key)
    assert match and match["kind"] == "reading" and match["ext"] == "csv", key
    assert "/cluster=c1/node=n1/" in key
    assert key.endswith(f"-{meta.batch_id}.csv")
    body, metadata = stored[key]
    rows = list(csv.reader(io.StringIO(body.decode())))
    assert tuple(rows[0][:7]) == ("cluster", "node", "machine", "source", "chassis", "gpu", "time")
    assert len(rows) == 9
    assert rows[1][:7] == ["c1", "n1", "m1", "test/agent", "CH-1", "SN-A", batch[0].read_time]
    assert rows[1][CSV_COLUMNS.index("record_id")] == wire_id(batch[0])
    assert metadata == {
        "source": "gpuid-agent",
        "record_count": "8",
        "format": "csv",
        "schema_version": "1",
        "batch_id": meta.batch_id,
        "kind": "reading",
        "columns": ",".join(CSV_COLUMNS),
        "header": "true",
    }


async def test_ndjson_gzip_and_no_header(
    make: Factory, moto_server: MotoServer, s3_bucket: str
) -> None:
    await make(fmt="ndjson", gzip_objects=True).export([*readings(1), allocation(pod="p")])
    await make(prefix="").export(readings(1))  # gpuid's default: no header
    stored = objects(moto_server, s3_bucket)
    kinds = {}
    for key in (k for k in stored if k.endswith(".ndjson.gz")):
        match = KEY.match(key)
        assert match, key
        assert stored[key][1]["format"] == "ndjson"
        lines = gzip.decompress(stored[key][0]).splitlines()
        kinds[match["kind"]] = [json.loads(x)["kind"] for x in lines]
    assert kinds == {"reading": ["reading"] * 4, "allocation": ["allocation"]}
    plain = next(k for k in stored if k.endswith(".csv"))
    assert plain.startswith("reading/year=")  # no prefix, no leading slash
    assert stored[plain][0].decode().splitlines()[0].startswith("c1,n1,m1,")
    assert stored[plain][1]["header"] == "false"


async def test_each_kind_under_its_own_prefix(
    make: Factory, moto_server: MotoServer, s3_bucket: str
) -> None:
    batch = [*readings(1), allocation(pod="p1"), allocation(pod="p2", node="n2"), health()]
    await make().export(batch, BatchMeta.new())
    stored = objects(moto_server, s3_bucket)
    found = {}
    for key, (_, metadata) in stored.items():
        match = KEY.match(key)
        assert match, key
        assert metadata["kind"] == match["kind"]
        found.setdefault(match["kind"], []).append((match["ext"], metadata["record_count"]))
    # one object per kind and node; only readings are CSV
    assert {k: sorted(v) for k, v in found.items()} == {
        "reading": [("csv", "4")],
        "allocation": [("ndjson", "1"), ("ndjson", "1")],
        "health": [("ndjson", "1")],
    }
    assert not any(".allocation." in k for k in stored)  # the old sibling name is gone


async def test_two_agents_same_second_never_collide(
    make: Factory, moto_server: MotoServer, s3_bucket: str
) -> None:
    created = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
    agents = [make(), make()]
    metas = [BatchMeta(BatchMeta.new().batch_id, created) for _ in range(6)]
    await asyncio.gather(*(agents[i % 2].export(readings(1), meta) for i, meta in enumerate(metas)))
    # a retry of a batch writes its own key again, with the same bytes
    await agents[0].export(readings(1), metas[0])
    stored = objects(moto_server, s3_bucket)
    assert len(stored) == 6
    assert {k.rsplit("-", 1)[1].split(".")[0] for k in stored} == {m.batch_id for m in metas}


async def test_outage_then_back_delivers_everything(tmp_path: Path) -> None:
    server = MotoServer()  # its own server: this test takes it down
    exporter = S3Exporter(
        "outage",
        endpoint_url=server.url,
        region="us-east-1",
        path_style=True,
        timeout=2.0,
        fmt="ndjson",
    )
    metrics = AgentMetrics()
    spool = DiskSpool(tmp_path / "s3", 1 << 20)
    policy = BatchPolicy(
        batch_size=4, flush_interval=0.02, retry_count=1, backoff_base=0.02, backoff_max=0.1
    )
    worker = ExporterWorker(exporter, policy, metrics, store=spool)
    task = asyncio.create_task(worker.run())
    batch = readings(5)
    try:
        for record in batch:
            await worker.put(record)
        await eventually(
            lambda: worker.describe()["consecutive_failures"] >= 2 and spool.batches == 5
        )
        assert not (worker.health()).ok
        assert (worker.health()).state == "degraded"
        await asyncio.to_thread(server.start)
        client: Any = server.client()
        client.create_bucket(Bucket="outage")
        client.close()
        await eventually(lambda: spool.batches == 0)
        stored = objects(server, "outage")
        ids = [
            json.loads(line)["record_id"]
            for body, _ in stored.values()
            for line in body.splitlines()
        ]
        assert sorted(ids) == sorted(wire_id(r) for r in batch)
        assert (await exporter.health()).ok
    finally:
        worker.close_intake()
        await asyncio.wait_for(task, 10)
        await exporter.close()
        await asyncio.to_thread(server.stop)


async def test_missing_bucket_is_retryable(make: Factory) -> None:
    exporter = make(bucket="no-such-bucket")
    with pytest.raises(ExportError) as info:
        await exporter.export(readings(1))
    assert info.value.retryable
    assert info.value.error_type == "s3_NoSuchBucket"
    health = await exporter.health()
    assert not health.ok
    assert "no-such-bucket" in (health.reason or "")


@given(st.text(max_size=200))
def test_key_parts_are_single_safe_segments(value: str) -> None:
    part = key_part(value)
    assert part
    assert "/" not in part
    assert part.strip(".")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", part)


@given(st.text(max_size=300))
def test_hive_values_decode_to_the_value(value: str) -> None:
    encoded = hive_value(value)
    assert re.fullmatch(r"[A-Za-z0-9._%-]*", encoded)
    assert "/" not in encoded and (encoded == "" or encoded.strip("."))
    assert len(encoded) <= 250
    raw = value.encode("utf-8", "replace")
    if len(encoded) < 248:  # not cut: Hive and DuckDB decode it back to the record's value
        assert urllib.parse.unquote_to_bytes(encoded) == raw


@given(
    st.lists(RECORDS, min_size=1, max_size=12),
    st.sampled_from(["", "gpuid", "a//b/", "../x"]),
    st.booleans(),
)
def test_every_record_lands_in_one_well_formed_key(
    batch: list[AnyRecord], prefix: str, ndjson: bool
) -> None:
    layout = Layout(prefix=prefix, fmt="ndjson" if ndjson else "csv")
    made = layout.objects(batch, BatchMeta.new())
    assert sum(int(o.metadata["record_count"]) for o in made) == len(batch)
    assert len({o.key for o in made}) == len(made)
    for obj in made:
        segments = obj.key.split("/")
        assert all(seg and seg.strip(".") for seg in segments), obj.key
        tail = segments[-7:]  # kind, year..hour, then cluster=, node=, and the name
        kind = segments[-8]
        assert kind == obj.metadata["kind"]
        assert [seg.split("=")[0] for seg in tail[:6]] == [
            "year",
            "month",
            "day",
            "hour",
            "cluster",
            "node",
        ]
        assert obj.key.startswith(layout.kind_root(kind) + "/year=")


@given(st.text(max_size=40))
def test_partition_pattern_never_breaks_keys(pattern: str) -> None:
    rendered = partition(pattern, BatchMeta.new())
    assert "//" not in rendered
    assert not rendered.startswith("/")
    assert not rendered.endswith("/")
    assert all(seg.strip(".") for seg in rendered.split("/") if rendered)


@given(st.lists(st.text(max_size=30), min_size=7, max_size=7))
def test_csv_round_trips_hostile_values(values: list[str]) -> None:
    record = dict(
        zip(
            ("cluster", "node", "machine", "source", "chassis", "gpu", "read_time"),
            values,
            strict=True,
        )
    )
    record["kind"] = "reading"
    body = to_csv([record], header=False).decode()
    (row,) = list(csv.reader(io.StringIO(body, newline="")))
    expected = [v.encode("utf-8", "replace").decode() for v in values]
    assert row[:7] == expected
