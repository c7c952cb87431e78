"""Objects written before, read beside the current layout by the documented DuckDB
statements: the previous layout (readings' CSV with a header straight under the prefix,
other kinds beside it as `<id>.<kind>.ndjson`) and gpuid's own (headerless seven-column
CSV under the prefix). The questions answer as over one layout."""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import datetime
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta
from gpuid_agent.delivery.exporters.s3 import S3Exporter, key_part, partition, to_csv, to_ndjson
from gpuid_agent.delivery.exporters.s3.layout import stamp
from gpuid_agent.records.serialize import Wire, to_wire
from gpuid_agent.records.types import AnyRecord
from tests.servers.s3 import MotoServer
from tests.test_s3_queries import (
    D1,
    DAY1,
    DOC_ROOT,
    EXPECTED,
    ask,
    connect,
    deliver,
    doc_sql,
    download,
    fleet_allocations,
    fleet_readings,
)


def write_previous(root: Path, readings: list[AnyRecord], allocations: list[AnyRecord]) -> None:
    """Keys and bodies as the previous versions named and wrote them (header on)."""
    meta = BatchMeta(BatchMeta.new().batch_id, DAY1)
    groups: dict[tuple[str, str, str], list[Wire]] = {}
    for record in map(to_wire, readings + allocations):
        group = (str(record["cluster"]), str(record["node"]), str(record["kind"]))
        groups.setdefault(group, []).append(record)
    for (cluster, node, kind), records in groups.items():
        folder = (
            root
            / "gpuid"
            / partition("year=%Y/month=%m/day=%d/hour=%H", meta)
            / f"cluster={key_part(cluster)}"
            / f"node={key_part(node)}"
        )
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{stamp(meta)}-{meta.batch_id}"
        if kind == "reading":
            (folder / f"{name}.csv").write_bytes(to_csv(records, header=True))
        else:
            (folder / f"{name}.{kind}.ndjson").write_bytes(to_ndjson(records))


def write_gpuid(root: Path, readings: list[AnyRecord]) -> None:
    """Objects as gpuid writes them: seven columns, no header, RFC 3339 seconds, one hour
    partition under the prefix, `<YYYYMMDD-HHMMSS.mmm>.csv`."""
    for i, record in enumerate(map(to_wire, readings)):
        when = datetime.fromisoformat(record["read_time"])
        folder = root / "gpuid" / when.strftime("year=%Y/month=%m/day=%d/hour=%H")
        folder.mkdir(parents=True, exist_ok=True)
        out = io.StringIO()
        row = [record[c] for c in ("cluster", "node", "machine", "source", "chassis", "gpu")]
        csv.writer(out).writerow([*row, when.strftime("%Y-%m-%dT%H:%M:%SZ")])
        (folder / f"{when:%Y%m%d-%H%M%S}.{i:03d}.csv").write_text(out.getvalue())


def write_current(moto: MotoServer, bucket: str, records: list[AnyRecord], tmp_path: Path) -> Path:
    async def write() -> None:
        exporter = S3Exporter(bucket, endpoint_url=moto.url, region="us-east-1", path_style=True)
        try:
            await deliver(exporter, records, tmp_path / "spool")
        finally:
            await exporter.close()

    asyncio.run(write())
    root = tmp_path / "bucket"
    download(moto, bucket, root)
    return root


def test_gpuid_objects_and_ours_answer_together(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    readings = fleet_readings()
    gpuid = [r for r in readings if r.read_time.startswith("2025-03-01")]
    ours = [r for r in readings if r not in gpuid] + fleet_allocations()
    root = write_current(moto_server, s3_bucket, ours, tmp_path)
    write_gpuid(root, gpuid)
    db = connect(root)
    db.execute(doc_sql()[("duckdb", "gpuid-objects")].replace(DOC_ROOT, str(root / "gpuid")))
    for name, expected in EXPECTED.items():
        if name == "gpus-per-day":  # gpuid's rows have no UUID: its GB200 dies count as one
            expected = [
                (D1, "prod east", 2, 2) if r[:2] == (D1, "prod east") else r for r in expected
            ]
        assert ask(db, name) == expected, name
    sources = db.execute("SELECT DISTINCT uuid IS NULL, record_id IS NULL FROM readings")
    assert sorted(sources.fetchall()) == [(False, False), (True, True)]


def test_previous_and_current_layout_answer_together(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    readings, allocations = fleet_readings(), fleet_allocations()
    # the first day's readings and the first allocation's records were written before
    old_readings = [r for r in readings if r.read_time.startswith("2025-03-01")]
    old_allocations = allocations[:2]
    assert {r.pod for r in old_allocations}  # type: ignore[union-attr] == {"eval"}
    new = [r for r in readings if r not in old_readings] + allocations[2:]
    root = write_current(moto_server, s3_bucket, new, tmp_path)
    write_previous(root, old_readings, old_allocations)
    db = connect(root)
    # the current layout alone misses the first day
    assert ask(db, "gpus-per-day") != EXPECTED["gpus-per-day"]
    db.execute(doc_sql()[("duckdb", "previous-layout")].replace(DOC_ROOT, str(root / "gpuid")))
    for name, expected in EXPECTED.items():
        assert ask(db, name) == expected, name
