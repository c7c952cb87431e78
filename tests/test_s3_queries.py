"""What the S3 exporter writes is read as is by DuckDB: the documented tables and questions
(docs/exporters/s3.md) run over the objects the real pipeline put into moto's S3 server."""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.s3 import S3Exporter, hive_value
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.facts import GpuIdentity, NodeInventory
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.health import health_records
from gpuid_agent.records.readings import reading_records
from gpuid_agent.records.types import AnyRecord
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.state.attribution import Allocation, Attribution, Holder
from gpuid_agent.state.health.verdicts import CheckStatus, Transition
from tests.servers.s3 import MotoServer

DOC = Path(__file__).resolve().parents[1] / "docs" / "exporters" / "s3.md"
BLOCK = re.compile(r"<!-- (duckdb|athena|query): ([a-z-]+) -->\n```sql\n(.*?)```", re.S)
DOC_ROOT = "s3://my-bucket/gpuid"
DAY1 = datetime(2025, 3, 1, tzinfo=UTC)


def doc_sql() -> dict[tuple[str, str], str]:
    return {(engine, name): sql for engine, name, sql in BLOCK.findall(DOC.read_text())}


# ---- the fleet the test feeds in ---------------------------------------------------------


def node_inventory(
    cluster: str, node: str, machine: str, serials: Sequence[str], when: datetime
) -> NodeInventory:
    gpus = tuple(
        GpuIdentity(index=i, uuid=f"GPU-{machine}-{i}", serial=s, name="NVIDIA GB200")
        for i, s in enumerate(serials)
    )
    return NodeInventory(node, cluster, machine, "dmi", "570.1", "12.8", gpus, when)


def fleet_readings() -> list[AnyRecord]:
    """Three days. SN-A (two dies) moves from m1 to m2 inside "prod east"; SN-B moves from
    "prod east" to "lab" (and so to another machine too); SN-C stays in "lab"."""
    days = [DAY1 + timedelta(days=d, hours=h) for d, h in ((0, 9), (1, 9), (2, 23))]
    nodes: list[tuple[str, str, str, list[str], int]] = [
        ("prod east", "gpu-1", "m1", ["SN-A", "SN-A", "SN-B", "SN-B"], 0),
        ("prod east", "gpu-1", "m1", ["SN-B", "SN-B"], 1),
        ("prod east", "gpu-2", "m2", ["SN-A", "SN-A"], 1),
        ("prod east", "gpu-2", "m2", ["SN-A", "SN-A"], 2),
        ("lab", "lab-1", "m3", ["SN-B", "SN-B"], 2),
        ("lab", "lab-2", "m4", ["SN-C"], 0),
        ("lab", "lab-2", "m4", ["SN-C"], 1),
        ("lab", "lab-2", "m4", ["SN-C"], 2),
    ]
    out: list[AnyRecord] = []
    for cluster, node, machine, serials, day in nodes:
        inv = node_inventory(cluster, node, machine, serials, days[day])
        out += reading_records(inv, source="gpuid-agent/test", reason="heartbeat")
    return out


def fleet_allocations() -> list[AnyRecord]:
    """The agent's own trail on node gpu-1, with a clock the test sets."""
    inv = node_inventory("prod east", "gpu-1", "m1", ["SN-A", "SN-A", "SN-B", "SN-B"], DAY1)
    train = Allocation(
        Holder("ml", "train", "main", "u1"), "nvidia.com/gpu", "GPU-m1-0", "GPU-m1-0"
    )
    evals = Allocation(Holder("ml", "eval", "main", "u2"), "nvidia.com/gpu", "GPU-m1-1", "GPU-m1-1")
    serve = Allocation(
        Holder("inf", "serve", "srv", "u3"), "nvidia.com/gpu", "GPU-m1-2::0", "GPU-m1-2", None, 0
    )
    still = Allocation(Holder("inf", "cache", "c", "u4"), "nvidia.com/gpu", "GPU-m1-3", "GPU-m1-3")
    steps: list[tuple[datetime, tuple[Allocation, ...]]] = [
        (DAY1 + timedelta(hours=10), (evals,)),
        (DAY1 + timedelta(hours=11, minutes=30), ()),  # eval: 1.5 h on day 1
        (DAY1 + timedelta(hours=22), (train,)),
        (DAY1 + timedelta(days=1), (train, serve)),
        (DAY1 + timedelta(days=1, hours=2), (serve, still)),  # train: 2 h + 2 h
        (DAY1 + timedelta(days=1, hours=6), (still,)),  # serve: 6 h on day 2; cache stays open
    ]
    now = [DAY1]
    trail = AllocationTrail(
        TrailIdentity("prod east", "gpu-1", "gpuid-agent/test"),
        publish_durable=_unused,
        clock=lambda: now[0],
    )
    out: list[AnyRecord] = []
    for when, held in steps:
        now[0] = when
        out += trail.owed(Attribution("current", held), inv)
    return out


def fleet_health() -> list[AnyRecord]:
    """Transitions on gpu-1: XID on GPU 0 and back, ECC on GPU 2 the next day, and a
    node-level check (no GPU)."""
    inv = node_inventory("prod east", "gpu-1", "m1", ["SN-A", "SN-A", "SN-B", "SN-B"], DAY1)

    def status(state: Any, hours: float, reason: str | None = None) -> CheckStatus:
        action: Any = "none" if state == "healthy" else "check_workload"
        return CheckStatus(state, reason, action, DAY1 + timedelta(hours=hours))

    ok = status("healthy", 0)
    transitions = [
        Transition("xid", status("degraded", 10, "XID 13"), ok, "GPU-m1-0", 0, "degraded"),
        Transition("xid", status("healthy", 12), status("degraded", 10), "GPU-m1-0", 0, "healthy"),
        Transition("ecc", status("unhealthy", 27, "DBE"), ok, "GPU-m1-2", 2, "unhealthy"),
        Transition("gpu_count", status("degraded", 28, "7 of 8"), ok),
    ]
    return health_records(transitions, inv, source="gpuid-agent/test")


async def _unused(records: list[AnyRecord]) -> None:
    raise AssertionError("the trail's records go through the exporter's worker here")


# ---- delivery and download --------------------------------------------------------------


async def deliver(exporter: S3Exporter, records: list[AnyRecord], spool_dir: Path) -> None:
    """Through the exporter's real worker and disk spool, in gpuid's default batch size."""
    policy = BatchPolicy(batch_size=10, flush_interval=0.05, backoff_base=0.05, backoff_max=0.2)
    spool = DiskSpool(spool_dir, 1 << 24)
    worker = ExporterWorker(exporter, policy, AgentMetrics(), store=spool)
    task = asyncio.create_task(worker.run())
    for record in records:
        await worker.put(record)
    worker.close_intake()
    await asyncio.wait_for(task, 60)
    assert spool.batches == 0


def download(moto: MotoServer, bucket: str, into: Path) -> list[str]:
    client: Any = moto.client()
    keys: list[str] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for item in page.get("Contents", []):
                key = item["Key"]
                target = into / key
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
                keys.append(key)
    finally:
        client.close()
    return keys


def connect(root: Path) -> duckdb.DuckDBPyConnection:
    """The documented DuckDB tables, over the local copy instead of s3://; readings from
    NDJSON objects when the bucket holds those (`S3_FORMAT=ndjson`)."""
    sql = doc_sql()
    readings, allocations = sql[("duckdb", "tables")].split(";")[:2]
    if not any((root / "gpuid" / "reading").rglob("*.csv*")):
        readings = sql[("duckdb", "readings-ndjson")]
    db = duckdb.connect()
    db.execute("SET TimeZone = 'America/Los_Angeles'")  # answers must not depend on it
    for statement in (readings, allocations):
        db.execute(statement.replace(DOC_ROOT, str(root / "gpuid")))
    return db


def ask(db: duckdb.DuckDBPyConnection, name: str) -> list[tuple[Any, ...]]:
    return db.execute(doc_sql()[("query", name)]).fetchall()


@pytest.fixture(params=["csv", "ndjson"])
def written(
    request: pytest.FixtureRequest, moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> Path:
    """The fleet's records written by the S3 exporter (readings in each S3_FORMAT), then
    copied out of the bucket."""

    async def write() -> None:
        exporter = S3Exporter(
            s3_bucket,
            endpoint_url=moto_server.url,
            region="us-east-1",
            path_style=True,
            timeout=5.0,
            fmt=request.param,
        )
        try:
            await deliver(exporter, fleet_readings() + fleet_allocations(), tmp_path / "spool")
        finally:
            await exporter.close()

    asyncio.run(write())
    keys = download(moto_server, s3_bucket, tmp_path / "bucket")
    assert {k.split("/")[1] for k in keys} == {"reading", "allocation"}
    ext = {"csv": ".csv", "ndjson": ".ndjson"}[request.param]
    assert all(k.endswith(ext) for k in keys if k.startswith("gpuid/reading/"))
    return tmp_path / "bucket"


# ---- the questions ------------------------------------------------------------------------


D1, D2, D3 = (date(2025, 3, d) for d in (1, 2, 3))
# What the fleet above says, question by question.
EXPECTED: dict[str, list[tuple[Any, ...]]] = {
    # (serial, machines, machine ids, first seen, last seen)
    "gpus-on-several-machines": [
        ("SN-A", 2, ["m1", "m2"], datetime(2025, 3, 1, 9), datetime(2025, 3, 3, 23)),
        ("SN-B", 2, ["m1", "m3"], datetime(2025, 3, 1, 9), datetime(2025, 3, 3, 23)),
    ],
    # (serial, clusters, first cluster, latest cluster, last seen)
    "gpus-that-moved-clusters": [("SN-B", 2, "prod east", "lab", datetime(2025, 3, 3, 23))],
    # (day, cluster, serials, GPUs by UUID); day 3's readings are at 23:00 UTC, still day 3
    # whatever the session's time zone
    "gpus-per-day": [
        (D1, "lab", 1, 1),
        (D1, "prod east", 2, 4),
        (D2, "lab", 1, 1),
        (D2, "prod east", 2, 4),
        (D3, "lab", 2, 3),
        (D3, "prod east", 1, 2),
    ],
    "gpu-hours-per-namespace-per-day": [
        (D1, "ml", 3.5),  # eval 1.5 h + train 22:00-24:00
        (D2, "inf", 6.0),  # serve; cache is still open and not counted
        (D2, "ml", 2.0),  # train 00:00-02:00
    ],
}


def test_gpus_seen_on_several_machines(written: Path) -> None:
    name = "gpus-on-several-machines"
    assert ask(connect(written), name) == EXPECTED[name]


def test_gpus_that_moved_clusters(written: Path) -> None:
    name = "gpus-that-moved-clusters"
    assert ask(connect(written), name) == EXPECTED[name]


def test_gpus_per_day(written: Path) -> None:
    assert ask(connect(written), "gpus-per-day") == EXPECTED["gpus-per-day"]


def test_gpu_hours_per_namespace_per_day(written: Path) -> None:
    name = "gpu-hours-per-namespace-per-day"
    assert ask(connect(written), name) == EXPECTED[name]


def test_health_view_reads_the_transitions(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    async def write() -> None:
        exporter = S3Exporter(
            s3_bucket, endpoint_url=moto_server.url, region="us-east-1", path_style=True
        )
        try:
            await deliver(exporter, fleet_health(), tmp_path / "spool")
        finally:
            await exporter.close()

    asyncio.run(write())
    root = tmp_path / "bucket"
    assert {k.split("/")[1] for k in download(moto_server, s3_bucket, root)} == {"health"}
    db = duckdb.connect()
    db.execute(doc_sql()[("duckdb", "health")].replace(DOC_ROOT, str(root / "gpuid")))
    rows = db.execute(
        'SELECT CAST(read_time AS DATE), cluster, gpu, uuid, "check", previous_state, state, '
        "reason FROM health WHERE state <> 'healthy' ORDER BY read_time"
    ).fetchall()
    assert rows == [
        (D1, "prod east", "SN-A", "GPU-m1-0", "xid", "healthy", "degraded", "XID 13"),
        (D2, "prod east", "SN-B", "GPU-m1-2", "ecc", "healthy", "unhealthy", "DBE"),
        (D2, "prod east", "", None, "gpu_count", "healthy", "degraded", "7 of 8"),
    ]
    assert db.execute("SELECT count(*) FROM health").fetchone() == (4,)


def test_partitions_prune_and_cluster_names_decode(written: Path) -> None:
    db = connect(written)
    now = datetime.now(UTC)  # batches are partitioned by the hour they were formed
    clusters = db.execute(
        "SELECT DISTINCT cluster FROM readings WHERE year = ? AND month = ? ORDER BY 1",
        [now.year, now.month],
    ).fetchall()
    assert clusters == [("lab",), ("prod east",)]  # `prod%20east` in the key
    assert db.execute("SELECT count(*) FROM readings WHERE year = 1999").fetchone() == (0,)
    total = db.execute("SELECT count(*), count(DISTINCT record_id) FROM readings").fetchone()
    assert total == (len(fleet_readings()), len(fleet_readings()))


def test_csv_with_header_and_gzip_read_by_the_same_view(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    async def write() -> None:
        exporter = S3Exporter(
            s3_bucket,
            endpoint_url=moto_server.url,
            region="us-east-1",
            path_style=True,
            csv_header=True,
            gzip_objects=True,
        )
        try:
            await exporter.export(fleet_readings()[:4], BatchMeta.new())
        finally:
            await exporter.close()

    asyncio.run(write())
    keys = download(moto_server, s3_bucket, tmp_path / "bucket")
    assert all(k.endswith(".csv.gz") for k in keys)
    tables = doc_sql()[("duckdb", "tables")].split(";")[0]
    tables = tables.replace("header = false", "header = true").replace(
        DOC_ROOT, str(tmp_path / "bucket" / "gpuid")
    )
    db = duckdb.connect()
    db.execute(tables)
    got = db.execute("SELECT gpu, uuid, read_time FROM readings ORDER BY uuid").fetchall()
    assert got == [
        ("SN-A", "GPU-m1-0", datetime(2025, 3, 1, 9)),
        ("SN-A", "GPU-m1-1", datetime(2025, 3, 1, 9)),
        ("SN-B", "GPU-m1-2", datetime(2025, 3, 1, 9)),
        ("SN-B", "GPU-m1-3", datetime(2025, 3, 1, 9)),
    ]


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(exclude_categories=("Cs",)), max_size=20))
@example("prod east")
@example("__HIVE_DEFAULT_PARTITION__")
@example("..")
@example("")
@example("007")
def test_duckdb_reads_escaped_partition_values_back(value: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / f"cluster={hive_value(value)}"
        folder.mkdir()
        (folder / "a.csv").write_text("x\n")
        db = duckdb.connect()
        (got,) = db.execute(
            "SELECT cluster FROM read_csv(?, header = false, hive_partitioning = true, "
            "hive_types = {'cluster': 'VARCHAR'}, columns = {'v': 'VARCHAR'})",
            [f"{tmp}/**/*.csv"],
        ).fetchone() or (None,)
    assert got == value
