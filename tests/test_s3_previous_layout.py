"""Objects of the previous layout (readings' CSV with a header straight under the prefix,
other kinds beside it as `<id>.<kind>.ndjson`) and the current one, read together by the
documented DuckDB statements: the questions answer as over one layout."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpuid_agent.delivery.exporters.base import BatchMeta, Record
from gpuid_agent.delivery.exporters.s3 import S3Exporter, key_part, partition, to_csv, to_ndjson
from gpuid_agent.delivery.exporters.s3.layout import stamp
from tests.servers.s3 import MotoServer
from tests.test_s3_queries import (
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


def write_previous(root: Path, readings: list[Record], allocations: list[Record]) -> None:
    """Keys and bodies as the previous versions named and wrote them (header on)."""
    meta = BatchMeta(BatchMeta.new().batch_id, DAY1)
    groups: dict[tuple[str, str, str], list[Record]] = {}
    for record in readings + allocations:
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


def test_previous_and_current_layout_answer_together(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    readings, allocations = fleet_readings(), fleet_allocations()
    # the first day's readings and the first allocation's records were written before
    old_readings = [r for r in readings if r["read_time"].startswith("2025-03-01")]
    old_allocations = allocations[:2]
    assert {r["pod"] for r in old_allocations} == {"eval"}
    new = [r for r in readings if r not in old_readings] + allocations[2:]

    async def write() -> None:
        exporter = S3Exporter(
            s3_bucket, endpoint_url=moto_server.url, region="us-east-1", path_style=True
        )
        try:
            await deliver(exporter, new, tmp_path / "spool")
        finally:
            await exporter.close()

    asyncio.run(write())
    root = tmp_path / "bucket"
    download(moto_server, s3_bucket, root)
    write_previous(root, old_readings, old_allocations)
    db = connect(root)
    # the current layout alone misses the first day
    assert ask(db, "gpus-per-day") != EXPECTED["gpus-per-day"]
    db.execute(doc_sql()[("duckdb", "previous-layout")].replace(DOC_ROOT, str(root / "gpuid")))
    for name, expected in EXPECTED.items():
        assert ask(db, name) == expected, name
