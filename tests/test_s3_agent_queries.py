"""The whole agent (simulated MIG node, in-process kubelet) into moto's S3 server; DuckDB
answers the documented questions over what it wrote, as the simulated hardware says."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gpuid_agent.agent import Agent
from gpuid_agent.simulate.profiles import PROFILES
from tests.conftest import running_agent, settings
from tests.servers.s3 import MotoServer
from tests.test_s3_queries import ask, connect, download
from tests.waiting import eventually

NODE = "sim-1"
CLUSTER = "sim east"  # a space: escaped in the key, whole in the queries


def kinds_written(moto: MotoServer, bucket: str) -> set[str]:
    client: Any = moto.client()
    try:
        contents = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    finally:
        client.close()
    return {item["Key"].split("/")[1] for item in contents}


async def test_agent_output_answers_the_documented_questions(
    moto_server: MotoServer, s3_bucket: str, tmp_path: Path
) -> None:
    agent = Agent(
        settings(
            simulate="mig",
            node_name=NODE,
            cluster_name=CLUSTER,
            pod_resources_interval=0.05,
            exporter_type="s3",
            s3_bucket=s3_bucket,
            s3_endpoint_url=moto_server.url,
            s3_region="us-east-1",
            s3_path_style=True,
            spool_dir=str(tmp_path / "spool"),
        )
    )
    async with running_agent(agent):
        await eventually(lambda: agent.trail.status()["open"] == 5, within=30)

        async def both_kinds_written() -> bool:
            found = await asyncio.to_thread(kinds_written, moto_server, s3_bucket)
            return {"reading", "allocation"} <= found

        await eventually(both_kinds_written, within=30, step=0.1)
    root = tmp_path / "bucket"
    keys = await asyncio.to_thread(download, moto_server, s3_bucket, root)
    assert any("/cluster=sim%20east/node=sim-1/" in k for k in keys)
    db = connect(root)

    gpus = PROFILES["mig"](NODE)
    serials = {g.serial for g in gpus if g.serial}
    today = datetime.now(UTC).date()
    rows = ask(db, "gpus-per-day")
    assert rows
    for day, cluster, n_serials, n_gpus in rows:
        assert day in {today, today - timedelta(days=1)}
        assert (cluster, n_serials, n_gpus) == (CLUSTER, len(serials), len(gpus))
    assert ask(db, "gpus-on-several-machines") == []
    assert ask(db, "gpus-that-moved-clusters") == []

    pods = db.execute(
        "SELECT DISTINCT pod FROM allocations WHERE event = 'start' ORDER BY 1"
    ).fetchall()
    assert [p for (p,) in pods] == [
        "llm-serve-0",
        "llm-serve-1",
        "llm-serve-2",
        "mig-job-0",
        "mig-job-1",
    ]
    held = db.execute("SELECT DISTINCT cluster, node, uuid FROM allocations").fetchall()
    assert {(c, n) for c, n, _ in held} == {(CLUSTER, NODE)}
    assert {u for _, _, u in held} <= {g.uuid for g in gpus}
    # every allocation is still open: no GPU-hours yet
    assert ask(db, "gpu-hours-per-namespace-per-day") == []
