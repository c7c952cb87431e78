"""SIGKILL the agent (a real subprocess) mid-batch, start it again: nothing spooled is lost and
PostgreSQL holds each record once."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import asyncpg

from tests.agent_subprocess import start_agent
from tests.exporter_support import spool_files, spooled_record_ids
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver, Reply
from tests.waiting import eventually


def spooled_ids(spool: Path) -> set[str]:
    return {
        record_id
        for exporter in ("postgres", "http")
        for path in spool_files(spool / exporter)
        for record_id in spooled_record_ids(path)
    }


async def test_sigkill_mid_batch_then_restart_loses_nothing(
    postgres: PostgresCluster, pg_schema: str, receiver: Receiver, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    table = f"{pg_schema}.gpu_readings"
    env = {
        **os.environ,
        **postgres.env(),
        "EXPORTER_TYPE": "postgres,http",
        "HTTP_ENDPOINT": receiver.url,
        "POSTGRES_TABLE": table,
        "SPOOL_DIR": str(spool),
        "NODE_NAME": "sim-kill",
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "COLLECT_INTERVAL": "0.05",
        "HEARTBEAT_INTERVAL": "0.05",
        "BATCH_SIZE": "4",
        "FLUSH_INTERVAL": "0.02",
        "RETRY_COUNT": "0",
        "RETRY_BACKOFF": "0.01",
        "RETRY_BACKOFF_MAX": "0.1",
        "TIMEOUT": "5",
        "LOG_LEVEL": "warning",
        # readings only (the table checked below): no simulated kubelet, so no allocations
        "POD_RESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
    }
    log = tmp_path / "agent.log"
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    locker = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    first = start_agent(env, log)
    try:

        async def rows() -> int:
            try:
                return int(await db.fetchval(f"SELECT count(*) FROM {table}"))
            except asyncpg.UndefinedTableError:
                return 0

        await eventually(lambda: len(receiver.accepted_ids()) >= 8, within=30)
        await eventually(lambda: rows(), within=30)
        # Stall both sinks mid-batch: the receiver holds its answer, the table is locked.
        receiver.default = Reply(503, hold=True)
        seen_before_stall = len(receiver.requests)
        lock = locker.transaction()
        await lock.start()
        await locker.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        await eventually(lambda: len(receiver.requests) > seen_before_stall)
        await eventually(
            lambda: all(len(spool_files(spool / n)) >= 2 for n in ("postgres", "http"))
        )
        first.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
        await lock.rollback()
        receiver.release.set()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    held = spooled_ids(spool)
    sent = {i for r in receiver.requests for i in r.record_ids}
    stored_before = set(await db.fetchval(f"SELECT array_agg(record_id) FROM {table}") or [])
    assert held - stored_before
    assert held - receiver.accepted_ids()
    must_arrive = held | sent | stored_before

    receiver.default = Reply(200)
    second = start_agent(env, log)
    try:

        async def all_stored() -> bool:
            stored = set(await db.fetchval(f"SELECT array_agg(record_id) FROM {table}") or [])
            return must_arrive <= stored

        await eventually(all_stored, within=40)
        await eventually(lambda: must_arrive <= receiver.accepted_ids(), within=40)
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 30) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
        total = await db.fetchval(f"SELECT count(*) FROM {table}")
        distinct = await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {table}")
        await db.close()
        await locker.close()
    assert total == distinct, "a record was stored twice"
    assert "Traceback" not in log.read_text()
