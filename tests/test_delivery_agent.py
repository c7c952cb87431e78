"""The agent as a real subprocess against real sinks, with its spool on a real tmpfs that is
remounted read-only or filled: one exporter degrades with the reason, the others keep
delivering, no task dies, memory stays bounded; /readyz never touches the database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest

from tests.delivery_support import Tmpfs, mount_tmpfs, tmp_files
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver, Reply
from tests.waiting import eventually

QUEUE_SIZE = 100
FIGURES: dict[str, Any] = {}  # printed with -s: the numbers the fault runs measured


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    base: str
    out: Path
    http: aiohttp.ClientSession

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.base + path) as response:
            text = await response.text()
            return response.status, (json.loads(text) if path != "/metrics" else text)

    async def exporter(self, name: str) -> dict[str, Any]:
        _, status = await self.get("/status")
        (found,) = [e for e in status["exporters"] if e["name"] == name]
        found["component"] = status["components"][f"exporter:{name}"]
        return found  # type: ignore[no-any-return]

    def stdout_records(self) -> int:
        return self.out.read_bytes().count(b"\n")


def started_port(log: Path) -> int | None:
    for line in log.read_text(errors="replace").splitlines():
        if '"agent started"' in line:
            return int(json.loads(line)["port"])
    return None


def spawn(env: dict[str, str], log: Path, out: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err, open(out, "ab") as stdout:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuid_agent", "run", "--simulate", "gb200x4"],
            env=env,
            stdout=stdout,
            stderr=err,
        )


@pytest.fixture
async def agent(tmp_path: Path, subprocess_env: dict[str, str]) -> AsyncIterator[Any]:
    procs: list[Running] = []

    async def start(**env: str) -> Running:
        log, out = tmp_path / "agent.log", tmp_path / "stdout.ndjson"
        full = subprocess_env | {
            "NODE_NAME": "sim-faults",
            "SERVER_ADDRESS": "127.0.0.1",
            "SERVER_PORT": "0",
            "LABELS": "off",
            "KUBE_API": "off",
            "LOG_LEVEL": "info",
            "COLLECT_INTERVAL": "0.05",
            "HEARTBEAT_INTERVAL": "0.05",
            "BATCH_SIZE": "10",
            "FLUSH_INTERVAL": "0.05",
            "QUEUE_SIZE": str(QUEUE_SIZE),
            "RETRY_COUNT": "0",
            "RETRY_BACKOFF": "0.01",
            "RETRY_BACKOFF_MAX": "0.2",
            "TIMEOUT": "5",
            **env,
        }
        proc = spawn(full, log, out)
        port = await eventually(lambda: proc.poll() is None and started_port(log), within=30)
        running = Running(proc, f"http://127.0.0.1:{port}", out, aiohttp.ClientSession())
        procs.append(running)
        return running

    yield start
    for running in procs:
        if running.proc.poll() is None:
            running.proc.terminate()
            try:
                await asyncio.to_thread(running.proc.wait, 20)
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()
        await running.http.close()
    assert "Traceback" not in (tmp_path / "agent.log").read_text(errors="replace")


@pytest.fixture
def spool_fs(tmp_path: Path) -> Any:
    yield from mount_tmpfs(tmp_path / "spool", "4m")


@pytest.fixture
def tiny_spool_fs(tmp_path: Path) -> Any:
    yield from mount_tmpfs(tmp_path / "spool", "64k")


def dropped(metrics: str, exporter: str) -> dict[str, float]:
    prefix = f'gpuid_dropped_records_total{{exporter="{exporter}",reason="'
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(prefix):
            reason = line[len(prefix) :].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


async def test_read_only_spool_mid_run_degrades_only_that_spool_and_recovers(
    agent: Any, spool_fs: Tmpfs, receiver: Receiver
) -> None:
    running: Running = await agent(
        EXPORTER_TYPE="http,stdout", HTTP_ENDPOINT=receiver.url, SPOOL_DIR=str(spool_fs.path)
    )
    await eventually(lambda: len(receiver.accepted_ids()) >= 20 and running.stdout_records() >= 20)
    spool_fs.read_only()
    try:
        seen_http, seen_stdout = len(receiver.accepted_ids()), running.stdout_records()

        async def degraded() -> dict[str, Any] | None:
            http = await running.exporter("http")
            return http if http["component"]["state"] == "degraded" else None

        http = await eventually(degraded, within=30)
        assert "Read-only file system" in http["component"]["reason"]
        assert f"spool {spool_fs.path / 'http'}" in http["component"]["reason"]
        # both keep delivering, and nothing died
        await eventually(
            lambda: (
                len(receiver.accepted_ids()) >= seen_http + 100
                and running.stdout_records() >= seen_stdout + 100
            ),
            within=30,
        )
        status, _ = await running.get("/healthz")
        assert status == 200
        held = max([(await running.exporter(n))["max_memory_records"] for n in ("http", "stdout")])
        assert held <= QUEUE_SIZE
    finally:
        spool_fs.writable()
    await eventually(lambda: _ok(running, "http"), within=30)
    resumed = len(receiver.accepted_ids())
    await eventually(lambda: len(receiver.accepted_ids()) > resumed + 20)
    _, metrics = await running.get("/metrics")
    FIGURES["read_only"] = {
        "http_delivered": len(receiver.accepted_ids()),
        "stdout_delivered": running.stdout_records(),
        "max_memory_records": held,
        "dropped": {n: dropped(metrics, n) for n in ("http", "stdout")},
        "tmp_files": len(tmp_files(spool_fs.path)),
    }
    print(FIGURES["read_only"])
    assert FIGURES["read_only"]["tmp_files"] == 0


async def _ok(running: Running, name: str) -> bool:
    return bool((await running.exporter(name))["component"]["state"] == "ok")


async def test_full_spool_disk_keeps_memory_bounded_and_counts_drops(
    agent: Any, tiny_spool_fs: Tmpfs, receiver: Receiver
) -> None:
    receiver.default = Reply(503)
    running: Running = await agent(
        EXPORTER_TYPE="http,stdout", HTTP_ENDPOINT=receiver.url, SPOOL_DIR=str(tiny_spool_fs.path)
    )

    async def dropping() -> dict[str, float]:
        _, metrics = await running.get("/metrics")
        return dropped(metrics, "http").get("spool_unwritable", 0.0) > 0 and dropped(
            metrics, "http"
        )

    drops = await eventually(dropping, within=60)
    http = await running.exporter("http")
    assert "No space left on device" in http["component"]["reason"]
    assert http["max_memory_records"] <= QUEUE_SIZE
    assert http["memory_records"] <= QUEUE_SIZE
    assert tmp_files(tiny_spool_fs.path) == []
    status, _ = await running.get("/healthz")
    assert status == 200
    stdout = await running.exporter("stdout")
    FIGURES["full_disk"] = {
        "http_delivered": http["delivered_records"],
        "stdout_delivered": running.stdout_records(),
        "http_max_memory_records": http["max_memory_records"],
        "stdout_max_memory_records": stdout["max_memory_records"],
        "http_dropped": drops,
        "tmp_files": len(tmp_files(tiny_spool_fs.path)),
    }
    print(FIGURES["full_disk"])
    assert running.stdout_records() > 0


async def test_readyz_polls_open_no_database_connection(
    agent: Any, postgres: PostgresCluster, pg_schema: str
) -> None:
    table = f"{pg_schema}.gpu_readings"
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        running: Running = await agent(
            **postgres.env(),
            EXPORTER_TYPE="postgres",
            POSTGRES_TABLE=table,
            # one collection, then nothing to write: any later query would be a probe
            COLLECT_INTERVAL="1h",
            HEARTBEAT_INTERVAL="1h",
            HEALTH_PROBE_INTERVAL="1h",
            # keep the delivery's connection open, so a probe would show on it
            POSTGRES_IDLE_TIMEOUT="1h",
            POD_RESOURCES_SOCKET=str(Path(os.devnull).parent / "no-kubelet.sock"),
        )

        async def written() -> bool:
            try:
                return bool(await db.fetchval(f"SELECT count(*) FROM {table}"))
            except asyncpg.UndefinedTableError:
                return False

        await eventually(written, within=30)
        await eventually(lambda: _ok(running, "postgres"))
        mine = await db.fetchval("SELECT pg_backend_pid()")
        since = await db.fetchval("SELECT clock_timestamp()")
        for _ in range(100):
            status, body = await running.get("/readyz")
            assert status == 200, body
        activity = await db.fetch(
            "SELECT pid, query, backend_start, state_change FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> $1",
            mine,
        )
    finally:
        await db.close()
    assert activity, "the agent holds no connection: nothing was measured"
    assert [a["pid"] for a in activity if a["backend_start"] >= since] == []
    touched = [dict(a) for a in activity if a["state_change"] and a["state_change"] >= since]
    assert touched == []
    FIGURES["readyz"] = {"polls": 100, "agent_backends": len(activity), "touched": 0}


async def test_an_outage_is_logged_once_while_status_counts_what_it_holds(
    agent: Any, tmp_path: Path, receiver: Receiver
) -> None:
    """Batches held and failed attempts move every second of an outage: /status shows them,
    the log says the outage began once and ended once."""
    running: Running = await agent(
        EXPORTER_TYPE="http", HTTP_ENDPOINT=receiver.url, SPOOL_DIR=str(tmp_path / "spool")
    )
    await eventually(lambda: len(receiver.accepted_ids()) >= 20)
    receiver.default = Reply(status=503, body="receiver down")
    down_at, held = time.monotonic(), set()

    async def held_for_a_while() -> bool:
        component = (await running.exporter("http"))["component"]
        if component["state"] == "degraded":
            held.add(component["figures"]["batches_held"])
        return len(held) >= 5 and time.monotonic() - down_at > 6

    await eventually(held_for_a_while, within=60)
    receiver.default = Reply()
    await eventually(lambda: _ok(running, "http"), within=30)
    lines = [json.loads(x) for x in (tmp_path / "agent.log").read_text().splitlines()]
    about_http = [x for x in lines if "http" in (x.get("exporter"), x.get("target", "")[9:])]
    warnings = [x["msg"] for x in about_http if x["level"] in ("warning", "error")]
    FIGURES["outage"] = {"batches_held_seen": sorted(held), "warning_lines": warnings}
    print(FIGURES["outage"])
    # the keeper's state change, the board's, and the outage's first failed attempt
    assert sorted(warnings) == [
        "export attempt failed",
        "exporter degraded",
        "exporter:http is degraded",
    ]


async def test_a_broken_allocations_table_holds_allocations_while_readings_flow(
    agent: Any, tmp_path: Path, postgres: PostgresCluster, pg_schema: str
) -> None:
    """An allocations table an older version left without a column: readings keep reaching
    their table, the allocations wait in the spool, the exporter says which table and what
    to do; once the column is added they arrive."""
    from gpuid_agent.delivery.exporters.postgres import PostgresExporter, Tables

    r, a = f"{pg_schema}.gpu_readings", f"{pg_schema}.gpu_allocations"
    maker = PostgresExporter(
        **postgres.connect_kwargs(),  # type: ignore[arg-type]
        sslmode="disable",
        tables=Tables.named(r, "gpu_allocations", "gpu_events"),
    )
    await maker.export([])  # the tables as this version makes them
    await maker.close()
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        await db.execute(f"ALTER TABLE {a} DROP COLUMN pod")
        running: Running = await agent(
            **postgres.env(),
            EXPORTER_TYPE="postgres",
            POSTGRES_TABLE=r,
            POSTGRES_AUTO_MIGRATE="false",
            SPOOL_DIR=str(tmp_path / "spool"),
        )

        async def readings() -> int:
            return int(await db.fetchval(f"SELECT count(*) FROM {r}"))

        async def degraded() -> dict[str, Any] | None:
            postgres_ = await running.exporter("postgres")
            return postgres_ if postgres_["component"]["state"] == "degraded" else None

        reason = (await eventually(degraded, within=30))["component"]["reason"]
        assert a in reason and '"pod"' in reason and "set POSTGRES_AUTO_MIGRATE=true" in reason
        first = await eventually(readings, within=30)
        await eventually(lambda: _more(readings, first), within=30)  # still flowing
        assert await db.fetchval(f"SELECT count(*) FROM {a}") == 0
        await db.execute(f"ALTER TABLE {a} ADD COLUMN pod VARCHAR(255)")
        await eventually(lambda: _ok(running, "postgres"), within=60)
        held = await db.fetchval(f"SELECT count(*) FROM {a} WHERE pod IS NOT NULL")
        FIGURES["broken_table"] = {"readings_while_broken": first, "allocations_after": held}
        print(FIGURES["broken_table"])
        assert held > 0
    finally:
        await db.close()


async def _more(count: Callable[[], Awaitable[int]], than: int) -> bool:
    return await count() > than
