"""Connection discipline of the PostgreSQL exporter, read from the real server's
pg_stat_activity: a connection only while delivering, none for health, and a server restart
costs no record."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables
from gpuid_agent.delivery.pipeline import BatchPolicy, ExporterWorker
from gpuid_agent.delivery.spool import DiskSpool
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.runtime.errors import ConfigError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.setup.delivery import make_exporters
from tests.exporter_support import readings, wire_id
from tests.servers.postgres import PostgresCluster
from tests.waiting import eventually


def exporter(postgres: PostgresCluster, schema: str, **kw: Any) -> PostgresExporter:
    return PostgresExporter(
        **postgres.connect_kwargs(),
        sslmode="disable",
        tables=Tables.named(f"{schema}.gpu_readings", "gpu_allocations", "gpu_events"),
        timeout=10.0,
        application_name=kw.pop("application_name", f"gpuid-test-{uuid.uuid4().hex[:8]}"),
        **kw,
    )


async def held(db: asyncpg.Connection, name: str) -> int:
    return int(
        await db.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name)
    )


async def test_connection_closed_after_idle(
    postgres: PostgresCluster, pg_schema: str, db: asyncpg.Connection
) -> None:
    sink = exporter(postgres, pg_schema, idle_timeout=0.5)
    try:
        await sink.export(readings(1))
        assert await held(db, sink.application_name) == 1
        await eventually(lambda: _none(db, sink.application_name), within=15, step=0.1)
        await sink.export(readings(1, node="again"))  # and it comes back when needed
        assert await db.fetchval(f"SELECT count(*) FROM {pg_schema}.gpu_readings") == 8
    finally:
        await sink.close()
    assert await held(db, sink.application_name) == 0


async def _none(db: asyncpg.Connection, name: str) -> bool:
    return await held(db, name) == 0


async def test_health_probes_open_no_connection(
    postgres: PostgresCluster, pg_schema: str, db: asyncpg.Connection
) -> None:
    sink = exporter(postgres, pg_schema)
    worker = ExporterWorker(sink, BatchPolicy(health_probe_interval=0.02), AgentMetrics())
    prober = asyncio.create_task(worker.probe_loop())
    try:
        samples = []
        for _ in range(25):  # sampled for 1 s, some 50 probe intervals: never a connection
            await asyncio.sleep(0.04)
            samples.append(await held(db, sink.application_name))
        assert samples == [0] * 25
        assert worker.health().ok
        connections = await db.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'gpuid%'"
        )
        assert connections == 0
    finally:
        prober.cancel()
        await sink.close()


def test_settings_name_the_node_and_the_idle_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "EXPORTER_TYPE": "postgres",
        "POSTGRES_HOST": "127.0.0.1",
        "POSTGRES_IDLE_TIMEOUT": "5s",
        "NODE_NAME": "gpu-node-7",
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    (sink,) = make_exporters(settings)
    assert isinstance(sink, PostgresExporter)
    assert sink.idle_timeout == 5.0
    assert sink.application_name == "gpuid-agent gpu-node-7"


async def test_server_restart_reconnects_and_loses_nothing(
    postgres: PostgresCluster, pg_schema: str, tmp_path: Any
) -> None:
    sink = exporter(postgres, pg_schema, idle_timeout=60.0)
    assert sink.stored_form is not None
    spool = DiskSpool(tmp_path / "postgres", 1 << 30, form=sink.stored_form)
    policy = BatchPolicy(
        batch_size=8, flush_interval=0.05, retry_count=1, backoff_base=0.05, backoff_max=0.3
    )
    worker = ExporterWorker(sink, policy, AgentMetrics(), store=spool)
    task = asyncio.create_task(worker.run())
    sent: list[dict[str, Any]] = []
    table = f"{pg_schema}.gpu_readings"
    try:
        for i in range(5):
            batch = readings(2, node=f"before-{i}")
            sent += batch
            for record in batch:
                await worker.put(record)
        await eventually(lambda: worker.describe()["delivered_records"] == len(sent), within=20)
        await asyncio.to_thread(postgres.stop_server, "fast")  # the held connection dies
        try:
            for i in range(5):
                batch = readings(2, node=f"during-{i}")
                sent += batch
                for record in batch:
                    await worker.put(record)
            await eventually(lambda: worker.describe()["consecutive_failures"] > 0, within=20)
            assert not worker.health().ok
            assert spool.records > 0  # held on disk meanwhile
        finally:
            await asyncio.to_thread(postgres.start_server)
        await eventually(lambda: worker.describe()["delivered_records"] == len(sent), within=30)
    finally:
        worker.close_intake()
        await asyncio.wait_for(task, 20)
        await sink.close()
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        stored = await db.fetch(f"SELECT record_id FROM {table}")
    finally:
        await db.close()
    assert sorted(r[0] for r in stored) == sorted(wire_id(r) for r in sent)
    assert worker.health().ok
    assert spool.records == 0


def test_idle_timeout_must_be_positive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPORTER_TYPE", "postgres")
    monkeypatch.setenv("POSTGRES_HOST", "127.0.0.1")
    monkeypatch.setenv("POSTGRES_IDLE_TIMEOUT", "0")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert set(info.value.problems) == {"POSTGRES_IDLE_TIMEOUT"}


@pytest.mark.parametrize(("given", "expected"), [(None, 30.0), ("5s", 5.0)])
def test_chart_sets_the_idle_timeout(
    given: str | None, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.chart_render import agent_container, render

    postgres: dict[str, Any] = {"host": "db.example"}
    if given:
        postgres["idleTimeout"] = given
    daemonset = render({"exporters": {"types": ["postgres"], "postgres": postgres}}).one(
        "DaemonSet"
    )
    env = {e["name"]: e.get("value") for e in agent_container(daemonset)["env"]}
    for name, value in env.items():
        if value is not None:
            monkeypatch.setenv(name, value)
    assert load_settings().postgres_idle_timeout == expected
