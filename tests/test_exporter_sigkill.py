"""SIGKILL the agent (a real subprocess) mid-batch, start it again: nothing spooled is lost. Then
the spool as the kill left it is put back and the agent started a third time, as after a crash
between the sinks taking those batches and their files being unlinked: everything is sent again
(the receiver counts it), and PostgreSQL still holds each record once."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg

from tests.agent_subprocess import start_agent
from tests.exporter_support import spool_files, spooled_record_ids
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver, Reply
from tests.waiting import eventually

SINKS = ("postgres", "http")
Check = Callable[[], Any]


def spooled_ids(spool: Path, *sinks: str) -> set[str]:
    return {
        i for sink in sinks for path in spool_files(spool / sink) for i in spooled_record_ids(path)
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
        waiting = (
            f"SELECT count(*) FROM pg_locks WHERE relation = '{table}'::regclass AND NOT granted"
        )
        await eventually(lambda: db.fetchval(waiting))  # the agent's write waits on the lock
        await eventually(lambda: all(len(spool_files(spool / n)) >= 2 for n in SINKS))
        first.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(first.wait, 10) == -signal.SIGKILL
        await lock.rollback()
        receiver.release.set()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    held = spooled_ids(spool, *SINKS)
    held_http = spooled_ids(spool, "http")
    sent = {i for r in receiver.requests for i in r.record_ids}
    stored_before = set(await db.fetchval(f"SELECT array_agg(record_id) FROM {table}") or [])
    assert held - stored_before
    assert held - receiver.accepted_ids()
    must_arrive = held | sent | stored_before

    kill_time = tmp_path / "kill-time"
    for name in SINKS:
        (kill_time / name).mkdir(parents=True)
        for path in spool_files(spool / name):
            shutil.copy2(path, kill_time / name / path.name)

    async def all_stored() -> bool:
        stored = set(await db.fetchval(f"SELECT array_agg(record_id) FROM {table}") or [])
        return must_arrive <= stored

    receiver.default = Reply(200)
    try:
        await run_until(env, log, all_stored, lambda: must_arrive <= receiver.accepted_ids())
        # All of it is stored: put the kill's spool back and start again.
        restored = [
            shutil.copy2(path, spool / name / path.name)
            for name in SINKS
            for path in spool_files(kill_time / name)
        ]
        await run_until(env, log, lambda: not any(Path(p).exists() for p in restored))
        total = await db.fetchval(f"SELECT count(*) FROM {table}")
        distinct = await db.fetchval(f"SELECT count(DISTINCT record_id) FROM {table}")
    finally:
        await db.close()
        await locker.close()
    accepted = Counter(i for r in receiver.requests if 200 <= r.status < 300 for i in r.record_ids)
    assert all(accepted[i] >= 2 for i in held_http), "the restored spool was not sent again"
    assert not any(spool_files(spool / name / "rejected") for name in SINKS)
    assert total == distinct, "a record was stored twice"
    assert "Traceback" not in log.read_text()


async def run_until(env: dict[str, str], log: Path, *checks: Check) -> None:
    """Start the agent, wait for each check in turn, stop it with SIGTERM."""
    agent = start_agent(env, log)
    try:
        for check in checks:
            await eventually(check, within=40)
        agent.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(agent.wait, 30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
