"""SIGKILL the agent (a real subprocess) again and again while pods come and go on a grpc
kubelet: every allocation it could see reaches PostgreSQL and the HTTP receiver with exactly one
start and, once gone, exactly one end.

Truth is kept on the kubelet's side. Its List calls are the clock: an allocation is owed once one
agent process was served it in OWED_AFTER List answers (several poll intervals, room for the
trail to reach the spool), or once a killed agent's state file held it open (the trail saves
that file only after its records are in the spool). One that lived only while no agent ran, or
only for a poll or two before a kill, cannot be asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import orjson

from gpuid_agent.facts import GpuIdentity
from gpuid_agent.records.allocations import AllocationTrail, TrailIdentity
from gpuid_agent.records.runner import run_emitter
from gpuid_agent.records.types import AllocationRecord
from gpuid_agent.simulate.profiles import gb200x4
from gpuid_agent.sources.kubelet import DeviceAssignment, PodResourcesSnapshot
from gpuid_agent.state.attribution import attribute
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot
from gpuid_agent.state.state_file import StateDir
from tests.agent_subprocess import start_agent
from tests.fakekubelet import FakeKubelet, KubeletPod, pod
from tests.servers.postgres import PostgresCluster
from tests.servers.receiver import Receiver
from tests.test_records_bus import snapshot
from tests.waiting import eventually

NODE = "sim-trailkill"
RESOURCE = "nvidia.com/gpu"
SEED = int(os.environ.get("TRAIL_SIGKILL_SEED", "20261124"))
KILLS = 10
STEPS = 44
OWED_AFTER = 8  # List answers to one agent process: room for a slow disk
HOLD = 8  # most List answers between two changes
POLL = 0.1

Key = tuple[str, str, str, str, str]  # namespace, pod, container, resource, device id


@dataclass
class Allocation:
    key: Key
    created: int  # List calls served when it appeared
    removed: int | None = None  # … and when it went; None: still there at the final stop

    @property
    def ended(self) -> bool:
        return self.removed is not None


@dataclass
class Truth:
    """What the kubelet showed, and when (in List calls) each agent process was running."""

    kubelet: FakeKubelet
    allocations: dict[Key, Allocation] = field(default_factory=dict)
    runs: list[tuple[int, int | None]] = field(default_factory=list)  # List calls: up, down
    in_state_file: set[Key] = field(default_factory=set)

    @property
    def calls(self) -> int:
        return self.kubelet.calls["List"]

    def set_pods(self, pods: list[KubeletPod]) -> None:
        now = self.calls
        keys = {
            (p.namespace, p.name, c.name, resource, device)
            for p in pods
            for c in p.containers
            for resource, ids in c.devices
            for device in ids
        }
        for key in keys - self.allocations.keys():
            self.allocations[key] = Allocation(key, now)
        for key, a in self.allocations.items():
            if a.removed is None and key not in keys:
                a.removed = now
        self.kubelet.pods = pods

    def views(self, a: Allocation) -> int:
        """The most List answers one agent process got while `a` was there."""
        best = 0
        end = a.removed if a.removed is not None else self.calls
        for up, down in self.runs:
            best = max(best, min(end, down if down is not None else end) - max(a.created, up))
        return best

    def describe(self, a: Allocation) -> str:
        why = "state file" if a.key in self.in_state_file else f"{self.views(a)} List answers"
        return f"{a.key[1]}/{a.key[4][-4:]} (owed by {why})"

    def owed(self) -> list[Allocation]:
        return [
            a
            for a in self.allocations.values()
            if self.views(a) >= OWED_AFTER or a.key in self.in_state_file
        ]


def state_file_keys(state_dir: Path) -> set[Key]:
    try:
        state = orjson.loads((state_dir / "allocations.json").read_bytes())
    except FileNotFoundError:
        return set()
    fields = ("namespace", "pod", "container", "resource_name", "device_id")
    return {tuple(r[f] for f in fields) for r in state["open"]}  # type: ignore[misc]


def record_key(r: dict[str, Any]) -> Key:
    return (r["namespace"], r["pod"], r["container"], r["resource_name"], r["device_id"])


async def test_allocation_trail_survives_repeated_sigkill(
    postgres: PostgresCluster,
    pg_schema: str,
    receiver: Receiver,
    subprocess_env: dict[str, str],
    tmp_path: Path,
) -> None:
    rng = random.Random(SEED)
    gpus = [g.uuid for g in gb200x4(NODE)]
    socket_dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    kubelet = FakeKubelet(str(socket_dir / "kubelet.sock"), allocatable=((RESOURCE, tuple(gpus)),))
    await kubelet.start()
    truth = Truth(kubelet)
    state_dir, spool = tmp_path / "state", tmp_path / "spool"
    table = f"{pg_schema}.gpu_allocations"
    env = {
        **subprocess_env,
        **postgres.env(),
        "EXPORTER_TYPE": "postgres,http",
        "HTTP_ENDPOINT": receiver.url,
        "POSTGRES_TABLE": f"{pg_schema}.gpu_readings",
        "SPOOL_DIR": str(spool),
        "STATE_DIR": str(state_dir),
        "POD_RESOURCES_SOCKET": kubelet.socket_path,
        "POD_RESOURCES_INTERVAL": str(POLL),
        "KUBE_API": "off",
        "LABELS": "off",
        "NODE_NAME": NODE,
        "CLUSTER_NAME": "test",
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": "0",
        "COLLECT_INTERVAL": str(POLL),
        "FLUSH_INTERVAL": "1",  # records wait this long in memory before a batch is spooled
        "RETRY_COUNT": "0",
        "RETRY_BACKOFF": "0.01",
        "RETRY_BACKOFF_MAX": "0.2",
        "TIMEOUT": "5",
        "LOG_LEVEL": "warning",
    }
    log = tmp_path / "agent.log"
    proc: subprocess.Popen[bytes] | None = None
    serial = 0
    held: dict[str, KubeletPod] = {}  # pod name → pod
    kills = restarts = 0
    kill_steps = set(rng.sample(range(2, STEPS - 4), KILLS))

    async def start() -> None:
        nonlocal proc
        truth.runs.append((truth.calls, None))
        proc = start_agent(env, log)
        before = truth.calls
        await eventually(lambda: truth.calls > before, within=30, what="a poll of the kubelet")

    async def kill() -> None:
        nonlocal proc, kills
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(proc.wait, 10) == -signal.SIGKILL
        truth.runs[-1] = (truth.runs[-1][0], truth.calls)
        truth.in_state_file |= state_file_keys(state_dir)
        proc, kills = None, kills + 1

    def churn() -> None:
        nonlocal serial
        for name in rng.sample(sorted(held), k=rng.randint(0, len(held))):
            del held[name]
        busy = {d for p in held.values() for c in p.containers for _, ids in c.devices for d in ids}
        free = [g for g in gpus if g not in busy]
        while free and rng.random() < 0.7:
            take = free[: rng.randint(1, min(2, len(free)))]
            free = free[len(take) :]
            serial += 1
            held[f"job-{serial}"] = pod("ml", f"job-{serial}", "main", RESOURCE, *take)
        truth.set_pods(list(held.values()))

    async def polls(n: int) -> None:
        """Let the kubelet answer `n` more List calls (or, with no agent, a few intervals)."""
        if proc is None:
            await asyncio.sleep(n * POLL)
            return
        target = truth.calls + n
        await eventually(lambda: truth.calls >= target, within=30, what=f"{n} more polls")

    try:
        await start()
        for step in range(STEPS):
            churn()
            if step in kill_steps:
                if rng.random() < 0.5:  # mid-step: while the agent may be diffing this change
                    await asyncio.sleep(rng.uniform(0, 2 * POLL))
                else:
                    await polls(rng.randint(1, HOLD))
                await kill()
                for _ in range(rng.randint(0, 2)):  # pods come and go while it is down
                    await polls(rng.randint(1, 4))
                    churn()
                await start()
                restarts += 1
            await polls(rng.randint(1, HOLD))
        # Settle: the last change seen by one agent for long enough, then a clean stop.
        await polls(OWED_AFTER + 2)
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
        truth.runs[-1] = (truth.runs[-1][0], truth.calls)
        proc = None
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        await kubelet.stop()
        socket_dir.rmdir()

    # HTTP: every allocation record the receiver accepted (re-sends after a kill included).
    http: list[dict[str, Any]] = [
        r
        for req in receiver.requests
        if 200 <= req.status < 300
        for r in req.records
        if r.get("kind") == "allocation"
    ]
    http_ids: dict[str, dict[str, Any]] = {r["record_id"]: r for r in http}
    http_events: dict[Key, Counter[str]] = defaultdict(Counter)
    for r in http_ids.values():
        http_events[record_key(r)][r["event"]] += 1
    db = await asyncpg.connect(**postgres.connect_kwargs())  # type: ignore[arg-type]
    try:
        rows = await db.fetch(
            f"SELECT namespace, pod, container, resource_name, device_id, allocation_id, "
            f"start_record_id, end_record_id, ended_at FROM {table}"
        )
        duplicates = await db.fetchval(
            f"SELECT count(*) - count(DISTINCT allocation_id) FROM {table}"
        )
    finally:
        await db.close()
    pg: dict[Key, list[asyncpg.Record]] = defaultdict(list)
    for row in rows:
        pg[tuple(row[:5])].append(row)  # type: ignore[index]

    owed = truth.owed()
    ended_owed = [a for a in owed if a.ended]
    print(
        f"\nseed {SEED}: {kills} kills, {restarts} restarts, {len(truth.allocations)} allocations"
        f" shown, {len(owed)} owed ({len(ended_owed)} ended before the stop,"
        f" {len(truth.in_state_file)} held in a killed agent's state file)"
        f"\n  http: {sum(c['start'] for c in http_events.values())} starts,"
        f" {sum(c['end'] for c in http_events.values())} ends in {len(http_ids)} record ids;"
        f" {len(http) - len(http_ids)} re-deliveries of a record id"
        f"\n  postgres: {len(rows)} rows, {sum(1 for r in rows if r['start_record_id'])} starts,"
        f" {sum(1 for r in rows if r['end_record_id'])} ends, {duplicates} duplicate ids"
    )

    problems: list[str] = []
    for a in owed:
        want_end = 1 if a.ended else 0
        got = http_events.get(a.key, Counter())
        if (got["start"], got["end"]) != (1, want_end):
            problems.append(f"http {truth.describe(a)}: {dict(got)}, end owed {want_end}")
        stored = pg.get(a.key, [])
        ends = [r for r in stored if r["end_record_id"]]
        if len(stored) != 1 or not stored[0]["start_record_id"] or len(ends) != want_end:
            problems.append(f"postgres {truth.describe(a)}: {len(stored)} rows, {len(ends)} ends")
    # Whatever was delivered, owed or not, is one start and (once gone) one end, never invented.
    for key, got in http_events.items():
        a = truth.allocations.get(key)
        if a is None or got["start"] != 1 or got["end"] != (1 if a.ended else 0):
            problems.append(f"http {key[1]}: {dict(got)} for {a}")
    for key, stored in pg.items():
        a = truth.allocations.get(key)
        if a is None or len(stored) != 1 or bool(stored[0]["end_record_id"]) != a.ended:
            problems.append(f"postgres {key[1]}: {len(stored)} rows for {a}")
    assert duplicates == 0
    assert not problems, f"{len(problems)} allocations off:\n" + "\n".join(problems)
    assert kills == KILLS and restarts == KILLS
    assert len(ended_owed) >= 10, "too little churn was seen to judge the trail"
    assert "Traceback" not in log.read_text()


def _node(seq: int, *pods: str) -> NodeSnapshot:
    gpu = GpuIdentity(index=0, uuid="GPU-00000000-0000-4000-8000-00000000000a", serial="S0")
    inventory = build_inventory(
        [gpu],
        node="n",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version=None,
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )
    held = tuple(DeviceAssignment("ns", p, "main", RESOURCE, gpu.uuid) for p in pods)
    return snapshot(seq, inventory, attribute(inventory, PodResourcesSnapshot(held)))


async def test_a_kill_between_saving_and_publishing_loses_no_record(tmp_path: Path) -> None:
    """The state file is saved with the records a change owes before they are published; a
    trail that dies before they reach the spools publishes them when it starts again, and an
    allocation gone by then still gets its end."""
    blocked = asyncio.Event()

    async def dies_mid_publish(records: list[dict[str, Any]]) -> None:
        blocked.set()
        await asyncio.Event().wait()

    identity = TrailIdentity("c", "n", "src")
    bus = SnapshotBus()
    first = AllocationTrail(
        identity, publish_durable=dies_mid_publish, state_dir=StateDir(str(tmp_path))
    )
    task = asyncio.create_task(run_emitter(bus.subscribe("allocations"), first))
    bus.publish(_node(1, "job-1"))
    await asyncio.wait_for(blocked.wait(), 10)
    task.cancel()  # the process dies here: the start is in no spool
    with contextlib.suppress(asyncio.CancelledError):
        await task

    published: list[AllocationRecord] = []

    async def spool(records: list[AllocationRecord]) -> None:
        published.extend(records)

    bus = SnapshotBus()
    second = AllocationTrail(identity, publish_durable=spool, state_dir=StateDir(str(tmp_path)))
    task = asyncio.create_task(run_emitter(bus.subscribe("allocations"), second))
    try:
        bus.publish(_node(1))  # job-1 went while no agent ran
        await eventually(lambda: len(published) == 2, within=10)
    finally:
        bus.close()
        await asyncio.wait_for(task, 10)
    assert [(r.pod, r.event, r.end_observed) for r in published] == [
        ("job-1", "start", None),
        ("job-1", "end", False),
    ]
    state = orjson.loads((tmp_path / "allocations.json").read_bytes())
    assert (state["open"], state["pending"]) == ([], [])
