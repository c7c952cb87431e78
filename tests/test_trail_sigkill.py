"""SIGKILL the agent (a real subprocess) at random moments while pods come and go on a real
kubelet fake, restart it with the same SPOOL_DIR and STATE_DIR, and compare kubelet truth with
PostgreSQL and the HTTP receiver: every allocation has exactly one start and one end in each
sink, and no record is stored twice. `-s` prints the figures."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import asyncpg

from gpuid_agent.simulate.profiles import gb200x4
from tests.exporter_support import eventually
from tests.fakekubelet import FakeKubelet, pod
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver

KILLS = 10
SEED = 20261124
NODE = "sim-trail"
SEEN = 5  # kubelet polls an allocation is shown for before it may go away


def start_agent(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "gpuid_agent", "run", "--simulate", "gb200x4"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


class Churn:
    """The kubelet's truth: which pods hold which device, and for how many polls."""

    def __init__(self, kubelet: FakeKubelet, rng: random.Random) -> None:
        self.kubelet, self.rng = kubelet, rng
        self.gpus = [g.uuid for g in gb200x4(NODE)]
        self.added_at: dict[str, int] = {}  # pod → List calls when it appeared
        self.shown: set[str] = set()  # every pod the kubelet ever showed
        self.serial = 0
        self.devices: dict[str, str] = {}  # pod → its device id, as the kubelet shows

    @property
    def polls(self) -> int:
        return self.kubelet.calls["List"]

    def publish(self) -> None:
        self.kubelet.pods = [
            pod("churn", name, "main", "nvidia.com/gpu", device)
            for name, device in sorted(self.devices.items())
        ]

    def add(self) -> None:
        self.serial += 1
        name = f"p{self.serial}"
        self.devices = {**self.devices, name: f"{self.rng.choice(self.gpus)}::{self.serial}"}
        self.added_at[name] = self.polls
        self.shown.add(name)
        self.publish()

    def removable(self, allowed: set[str] | None = None) -> list[str]:
        return [
            p
            for p in sorted(self.devices)
            if self.polls - self.added_at[p] >= SEEN and (allowed is None or p in allowed)
        ]

    def remove(self, name: str) -> None:
        self.devices = {p: d for p, d in self.devices.items() if p != name}
        self.publish()

    async def step(self) -> None:
        gone = self.removable()
        if gone and (len(self.devices) >= 6 or self.rng.random() < 0.4):
            self.remove(self.rng.choice(gone))
        else:
            self.add()


def delivered(receiver: Receiver) -> dict[tuple[str, str], set[str]]:
    """(pod, event) → distinct record ids the receiver accepted."""
    out: dict[tuple[str, str], set[str]] = {}
    for request in receiver.requests:
        if 200 <= request.status < 300:
            for r in request.records:
                if r.get("kind") == "allocation":
                    out.setdefault((r["pod"], r["event"]), set()).add(r["record_id"])
    return out


async def test_allocation_trail_survives_sigkill_during_pod_churn(
    postgres: PostgresCluster,
    pg_schema: str,
    receiver: Receiver,
    kubelet: FakeKubelet,
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    churn = Churn(kubelet, rng)
    allocations = f"{pg_schema}.gpu_allocations"
    env = {
        **os.environ,
        **postgres.env(),
        "EXPORTER_TYPE": "postgres,http",
        "HTTP_ENDPOINT": receiver.url,
        "POSTGRES_TABLE": f"{pg_schema}.gpu_readings",
        "POSTGRES_ALLOCATIONS_TABLE": allocations,
        "SPOOL_DIR": str(tmp_path / "spool"),
        "STATE_DIR": str(tmp_path / "state"),
        "POD_RESOURCES_SOCKET": kubelet.socket_path,
        "POD_RESOURCES_INTERVAL": "0.05",
        "KUBE_API": "off",
        "NODE_NAME": NODE,
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "COLLECT_INTERVAL": "0.2",
        "HEARTBEAT_INTERVAL": "60",
        "FLUSH_INTERVAL": "0.5",  # records wait in the intake: a kill lands there often
        "RETRY_BACKOFF": "0.01",
        "RETRY_BACKOFF_MAX": "0.1",
        "TIMEOUT": "5",
        "LOG_LEVEL": "warning",
    }
    log = tmp_path / "agent.log"
    kills = down_changes = 0
    for _ in range(KILLS):
        agent = start_agent(env, log)
        try:
            await eventually(lambda p=churn.polls: churn.polls >= p + 3, timeout=30)
            for _ in range(rng.randint(2, 6)):
                await churn.step()
                await asyncio.sleep(rng.uniform(0.02, 0.3))
            await asyncio.sleep(rng.uniform(0.0, 0.5))  # the kill lands anywhere
            agent.send_signal(signal.SIGKILL)
            assert await asyncio.to_thread(agent.wait, 10) == -signal.SIGKILL
            kills += 1
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        # The kubelet moves on while the agent is down: a pod whose start reached a sink
        # leaves (its end is owed after the restart), and a new one arrives.
        started = {p for (p, e) in delivered(receiver) if e == "start"}
        if gone := churn.removable(started):
            churn.remove(rng.choice(gone))
            down_changes += 1
        churn.add()

    # Last run: everything left goes away once seen, then a clean stop.
    agent = start_agent(env, log)
    try:
        while churn.devices:
            await eventually(lambda: churn.removable(), timeout=30)
            for name in churn.removable():
                churn.remove(name)
        truth = churn.shown
        await eventually(
            lambda: all(len(delivered(receiver).get((p, "end"), ())) for p in truth), timeout=40
        )
        db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
        try:

            async def all_ended() -> bool:
                try:
                    n = await db.fetchval(
                        f"SELECT count(*) FROM {allocations} WHERE ended_at IS NOT NULL"
                    )
                except asyncpg.UndefinedTableError:
                    return False
                return int(n) >= len(truth)

            await eventually(all_ended, timeout=40)
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(agent.wait, 30) == 0
            rows = await db.fetch(
                f"SELECT pod, allocation_id, start_record_id, end_record_id, ended_at "
                f"FROM {allocations}"
            )
            readings = await db.fetchrow(
                f"SELECT count(*) AS n, count(DISTINCT record_id) AS d "
                f"FROM {pg_schema}.gpu_readings"
            )
        finally:
            await db.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()

    http = delivered(receiver)
    http_all = Counter(
        (r["pod"], r["event"], r["record_id"])
        for q in receiver.requests
        if 200 <= q.status < 300
        for r in q.records
        if r.get("kind") == "allocation"
    )
    pg_rows = Counter(r["pod"] for r in rows)
    print(
        f"\ntrail sigkill: kills={kills} allocations={len(truth)} "
        f"changes-while-down={down_changes} "
        f"http starts={sum(len(http.get((p, 'start'), ())) for p in truth)} "
        f"http ends={sum(len(http.get((p, 'end'), ())) for p in truth)} "
        f"http re-deliveries={sum(n - 1 for n in http_all.values())} "
        f"pg rows={len(rows)} pg starts={sum(1 for r in rows if r['start_record_id'])} "
        f"pg ends={sum(1 for r in rows if r['end_record_id'])} "
        f"pg reading duplicates={readings['n'] - readings['d']}"
    )
    for p in truth:
        assert len(http.get((p, "start"), ())) == 1, (p, "start", http.get((p, "start")))
        assert len(http.get((p, "end"), ())) == 1, (p, "end", http.get((p, "end")))
        assert pg_rows[p] == 1, (p, "rows in PostgreSQL")
    assert {(p, e) for p, e in http} <= {(p, e) for p in truth for e in ("start", "end")}
    assert all(r["start_record_id"] and r["end_record_id"] and r["ended_at"] for r in rows)
    assert readings["n"] == readings["d"], "a reading was stored twice"
    assert "Traceback" not in log.read_text()
