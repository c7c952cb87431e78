"""Fan-out, the spool in the pipeline, outages, readiness — with real exporters and servers."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.base import Exporter
from gpuid_agent.delivery.exporters.http import HttpExporter
from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.delivery.pipeline import BatchPolicy, Pipeline, build_pipeline
from gpuid_agent.runtime.config import Settings
from gpuid_agent.runtime.metrics import AgentMetrics
from tests.exporter_support import readings, wire_id
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver, Reply
from tests.waiting import eventually

FAST = BatchPolicy(
    batch_size=4,
    flush_interval=0.02,
    queue_size=1000,
    retry_count=1,
    timeout=3.0,
    backoff_base=0.01,
    backoff_max=0.05,
)
DEAD_URL = "http://127.0.0.1:1/ingest"


@pytest.fixture
async def running() -> AsyncIterator[list[tuple[Pipeline, list[asyncio.Task[None]]]]]:
    started: list[tuple[Pipeline, list[asyncio.Task[None]]]] = []
    yield started
    for pipeline, tasks in started:
        for worker in pipeline.workers:
            worker.close_intake()
        _, pending = await asyncio.wait(tasks, timeout=10)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        for worker in pipeline.workers:
            await worker.exporter.close()


def start(
    running: list[tuple[Pipeline, list[asyncio.Task[None]]]],
    exporters: list[Exporter],
    policy: BatchPolicy = FAST,
    **kw: Any,
) -> Pipeline:
    pipeline = build_pipeline(exporters, policy, AgentMetrics(), **kw)
    running.append((pipeline, [asyncio.create_task(w.run()) for w in pipeline.workers]))
    return pipeline


def sample(pipeline: Pipeline, name: str, labels: dict[str, str]) -> float:
    value = pipeline._metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def test_dead_sink_blocks_neither_producer_nor_other_exporters(
    running: Any, receiver: Receiver, tmp_path: Path
) -> None:
    out = io.BytesIO()
    dead = PostgresExporter(host="127.0.0.1", port=1, sslmode="disable", timeout=1.0)
    pipeline = start(
        running, [dead, HttpExporter(receiver.url), StdoutExporter(out)], spool_dir=str(tmp_path)
    )
    records = readings(50)
    await asyncio.wait_for(pipeline.publish(records), 10)
    ids = {wire_id(r) for r in records}
    await eventually(lambda: receiver.accepted_ids() == ids)
    await eventually(lambda: len(out.getvalue().splitlines()) == 200)
    postgres = pipeline.workers[0]
    await eventually(
        lambda: postgres.store.records == 200 and postgres.describe()["consecutive_failures"] > 0
    )
    assert {p.name for p in tmp_path.iterdir()} == {"postgres", "http", "stdout"}
    healths = pipeline.health()
    assert healths["postgres"].state == "degraded"
    assert "held in" in (healths["postgres"].reason or "")
    assert healths["http"].state == "ok"
    assert Pipeline.ready(healths)
    assert sample(pipeline, "gpuid_spool_batches", {"exporter": "postgres"}) == 50
    assert sample(pipeline, "gpuid_spool_bytes", {"exporter": "postgres"}) > 0
    assert (
        sample(
            pipeline,
            "gpuid_export_failure_total",
            {"exporter": "postgres", "error_type": "connection"},
        )
        > 0
    )
    assert (
        sample(pipeline, "gpuid_exporter_state", {"exporter": "postgres", "state": "degraded"}) == 1
    )


async def test_memory_only_sink_drops_oldest_instead_of_blocking(
    running: Any, caplog: pytest.LogCaptureFixture
) -> None:
    policy = BatchPolicy(
        batch_size=4,
        flush_interval=0.02,
        queue_size=8,
        retry_count=0,
        timeout=1.0,
        backoff_base=0.01,
        backoff_max=0.05,
    )
    pipeline = start(running, [HttpExporter(DEAD_URL, timeout=1.0)], policy)
    assert "running memory-only" in caplog.text
    await asyncio.wait_for(pipeline.publish(readings(25)), 10)
    (worker,) = pipeline.workers
    await eventually(lambda: worker.describe()["dropped_records"] >= 80)
    assert worker.store.records <= 8 + 4  # the bound, plus the batch in flight
    dropped = {
        reason: sample(
            pipeline, "gpuid_dropped_records_total", {"exporter": "http", "reason": reason}
        )
        for reason in ("buffer_full", "intake_full")
    }
    assert sum(dropped.values()) == worker.describe()["dropped_records"] >= 80
    assert dropped["buffer_full"] > 0
    healths = pipeline.health()
    assert healths["http"].state == "unavailable"
    assert not Pipeline.ready(healths)


async def test_every_sink_down_then_back_loses_nothing(
    running: Any, receiver: Receiver, postgres: PostgresCluster, pg_schema: str, tmp_path: Path
) -> None:
    """PostgreSQL stopped and the receiver failing; records keep coming; both come back."""
    receiver.default = Reply(503)
    exporter = PostgresExporter(
        **postgres.connect_kwargs(),
        sslmode="disable",
        timeout=2.0,  # type: ignore[arg-type]
        tables=Tables.named(f"{pg_schema}.gpu_readings", "gpu_allocations", "gpu_events"),
    )
    await exporter.export(readings(1, node="before"))
    await asyncio.to_thread(postgres.stop_server, "immediate")
    try:
        pipeline = start(running, [exporter, HttpExporter(receiver.url)], spool_dir=str(tmp_path))
        records = readings(1, node="before")
        for i in range(10):
            batch = readings(3, node=f"n{i}")
            records += batch
            await pipeline.publish(batch)
        await eventually(
            lambda: all(w.describe()["consecutive_failures"] >= 2 for w in pipeline.workers)
        )
        healths = pipeline.health()
        assert {h.state for h in healths.values()} == {"degraded"}
    finally:
        await asyncio.to_thread(postgres.start_server)
    receiver.default = Reply(200)
    await pipeline.publish(readings(1, node="after"))
    records += readings(1, node="after")
    ids = {wire_id(r) for r in records}
    await eventually(
        lambda: ids - {wire_id(r) for r in readings(1, node="before")} <= receiver.accepted_ids()
    )
    conn = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        table = f"{pg_schema}.gpu_readings"

        async def stored() -> bool:
            got = set(await conn.fetchval(f"SELECT array_agg(record_id) FROM {table}") or [])
            return got == ids

        await eventually(stored)
        assert await conn.fetchval(f"SELECT count(*) FROM {table}") == len(ids)
    finally:
        await conn.close()
    await eventually(lambda: all(w.store.batches == 0 for w in pipeline.workers))


async def test_shutdown_keeps_undelivered_batches_in_the_spool(
    tmp_path: Path, receiver: Receiver
) -> None:
    receiver.default = Reply(503)
    pipeline = build_pipeline(
        [HttpExporter(receiver.url)], FAST, AgentMetrics(), spool_dir=str(tmp_path)
    )
    (worker,) = pipeline.workers
    task = asyncio.create_task(worker.run())
    await pipeline.publish(readings(3))
    await eventually(
        lambda: worker.store.batches == 3 and worker.describe()["consecutive_failures"] > 0
    )
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    await worker.exporter.close()
    assert len(list((tmp_path / "http").glob("*.ndjson"))) == 3
    # the next start re-sends them
    receiver.default = Reply(200)
    again = build_pipeline(
        [HttpExporter(receiver.url)], FAST, AgentMetrics(), spool_dir=str(tmp_path)
    )
    (worker,) = again.workers
    task = asyncio.create_task(worker.run())
    await eventually(lambda: len(receiver.accepted_ids()) == 12)
    worker.close_intake()
    await asyncio.wait_for(task, 10)
    await worker.exporter.close()
    assert not list((tmp_path / "http").glob("*.ndjson"))


def test_unused_exporters_libraries_are_not_imported() -> None:
    script = """
import sys
from gpuid_agent.setup.delivery import make_exporters
from gpuid_agent.runtime.config import Settings
chosen = sys.argv[1]
extra = {"http": {"http_endpoint": "http://127.0.0.1:1/x"}, "postgres": {"postgres_host": "h"},
         "s3": {"s3_bucket": "b"}, "stdout": {},
         "otlp": {"otel_exporter_otlp_endpoint": "http://127.0.0.1:1"}}[chosen]
make_exporters(Settings(exporter_type=chosen, **extra))
print(sorted({m.split(".")[0] for m in sys.modules} & {"asyncpg", "aiobotocore", "botocore", "opentelemetry"}))
"""
    procs = {
        chosen: subprocess.Popen(
            [sys.executable, "-c", script, chosen], stdout=subprocess.PIPE, text=True
        )
        for chosen in ("stdout", "http", "postgres", "s3", "otlp")
    }
    seen = {}
    for chosen, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        seen[chosen] = json.loads(out.strip().replace("'", '"'))
    assert seen == {
        "stdout": [],
        "http": [],
        "postgres": ["asyncpg"],
        "s3": ["aiobotocore", "botocore"],
        "otlp": ["opentelemetry"],
    }


async def test_agent_readiness_and_status_with_a_down_exporter(
    tmp_path: Path, receiver: Receiver
) -> None:
    settings = Settings(
        simulate="gb200x4",
        node_name="sim-1",
        exporter_type="http",
        http_endpoint=DEAD_URL,
        spool_dir=str(tmp_path),
        server_address="127.0.0.1",
        server_port=0,
        collect_interval=0.05,
        heartbeat_interval=0.05,
        flush_interval=0.02,
        retry_count=0,
        retry_backoff=0.01,
        retry_backoff_max=0.05,
        http_timeout=1.0,
        shutdown_grace=2.0,
    )
    agent = Agent(settings)
    await agent.start()
    try:
        (worker,) = agent.pipeline.workers
        await eventually(
            lambda: worker.store.batches >= 2 and worker.describe()["consecutive_failures"] > 0
        )
        async with aiohttp.ClientSession() as http:
            base = f"http://127.0.0.1:{agent.bound_port}"
            async with http.get(f"{base}/readyz") as response:
                ready = await response.json()
                assert response.status == 200, ready  # degraded is not "not ready"
            async with http.get(f"{base}/status") as response:
                status = await response.json()
            async with http.get(f"{base}/metrics") as response:
                metrics = await response.text()
    finally:
        await agent.stop()
    assert status["components"]["exporter:http"]["state"] == "degraded"
    (described,) = status["exporters"]
    assert described["durable"]
    assert described["stored_batches"] >= 2
    assert described["store"] == str(tmp_path / "http")
    assert 'gpuid_exporter_state{exporter="http",state="degraded"} 1.0' in metrics
    # what was not delivered is still on disk for the next start
    assert list((tmp_path / "http").glob("*.ndjson"))
