"""Upgrade from the previous release and roll back from the next one, on the same STATE_DIR and
SPOOL_DIR, losing nothing.

Upgrade: the previous release (built from this repository's history, `tests/previous_release.py`)
runs on a simulated node against a dead sink until it holds a spooled backlog, open allocations
and a latched XID, and is killed; this version starts on its directories with the sink alive:
every record the old one left is delivered exactly once, the allocation still held continues (no
second start), the one that ended meanwhile is closed as unseen, the XID stays latched.

Rollback: a version one format ahead (this tree with every format raised by one) writes its files
and spools against a dead sink; this version then starts on them with the sink alive: every
newer file stays where it is byte for byte, nothing is sent, set aside or deleted, each is
reported once (log, /status, /metrics); the newer version, started again, reads its files and
delivers its backlog exactly once.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.runtime import formats
from gpuid_agent.simulate.profiles import gb200x4
from tests.conftest import free_port
from tests.exporter_support import spool_files, spooled_record_ids
from tests.fakekubelet import FakeKubelet, KubeletPod, pod
from tests.previous_release import newer_copy, release_agent
from tests.waiting import eventually

NODE = "sim-upgrade"
GPU = "nvidia.com/gpu"
POLL = 0.1
STATE_FILES = formats.STATE_FILES


class Sink:
    """The HTTP exporter's receiver, on a port chosen before it listens (the agents first
    find nothing there); counts every record id it accepted."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.records: list[dict[str, Any]] = []
        self._runner: web.AppRunner | None = None

    async def _ingest(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        self.records.extend(orjson.loads(raw))
        return web.Response(text="ok")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/ingest", self._ingest)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def counts(self) -> Counter[str]:
        return Counter(r["record_id"] for r in self.records)

    def allocation_events(self, pod_name: str, event: str) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records
            if r.get("kind") == "allocation" and r["pod"] == pod_name and r["event"] == event
        ]


class Node:
    """The directories, kubelet and sink one simulated node's agents share, and how to start
    one of them."""

    def __init__(self, tmp: Path, base_env: dict[str, str], kubelet: FakeKubelet) -> None:
        self.tmp, self.kubelet = tmp, kubelet
        self.state, self.spool = tmp / "state", tmp / "spool" / "http"
        self.sink = Sink(free_port())
        self.env = {k: v for k, v in base_env.items() if k != "PYTHONPATH"}
        self.env.update(
            {
                "EXPORTER_TYPE": "http",
                "HTTP_ENDPOINT": f"http://127.0.0.1:{self.sink.port}/ingest",
                "SPOOL_DIR": str(tmp / "spool"),
                "STATE_DIR": str(self.state),
                "POD_RESOURCES_SOCKET": kubelet.socket_path,
                "POD_RESOURCES_INTERVAL": str(POLL),
                "COLLECT_INTERVAL": str(POLL),
                "KUBE_API": "off",
                "LABELS": "off",
                "NODE_NAME": NODE,
                "CLUSTER_NAME": "test",
                "SERVER_ADDRESS": "127.0.0.1",
                "FLUSH_INTERVAL": "0.2",
                "RETRY_COUNT": "0",
                "RETRY_BACKOFF": "0.05",
                "RETRY_BACKOFF_MAX": "0.5",
                "TIMEOUT": "5",
                "LOG_LEVEL": "info",
            }
        )
        self.port = 0

    def start(
        self, name: str, argv: list[str], *, cwd: Path, **extra: str
    ) -> subprocess.Popen[bytes]:
        self.port = free_port()
        env = {**self.env, "SERVER_PORT": str(self.port), **extra}
        with open(self.tmp / f"{name}.log", "ab") as err:
            return subprocess.Popen(
                [*argv, "run", "--simulate", "gb200x4"],
                env=env,
                cwd=cwd,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )

    def log(self, name: str) -> list[dict[str, Any]]:
        lines = (self.tmp / f"{name}.log").read_bytes().splitlines()
        return [orjson.loads(line) for line in lines if line.startswith(b"{")]

    async def get(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.port}{path}") as response,
        ):
            return await (response.text() if path == "/metrics" else response.json())

    async def status(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = await self.get("/status")
        except aiohttp.ClientError:
            return None  # not listening yet
        return found

    def state_doc(self, name: str) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = orjson.loads((self.state / name).read_bytes())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return {}
        return doc

    def spooled(self) -> dict[str, list[str]]:
        """Batch file name → its record ids."""
        return {p.name: spooled_record_ids(p) for p in spool_files(self.spool)}

    def spooled_kinds(self) -> Counter[str]:
        """How many spooled records of each kind (allocations by event)."""
        kinds: Counter[str] = Counter()
        for path in spool_files(self.spool):
            for line in path.read_bytes().splitlines():
                record = orjson.loads(line)
                kinds[record["kind"] + (f" {record['event']}" if "event" in record else "")] += 1
        return kinds

    def owed(self) -> list[str]:
        """The record ids the state files owe (saved before they reach the spool)."""
        docs = (self.state_doc(formats.ALLOCATIONS), self.state_doc(formats.HARDWARE))
        return [r["record_id"] for doc in docs for r in doc.get("pending", [])]

    def set_aside(self) -> list[Path]:
        return [
            *(self.state / "rejected").glob("*"),
            *(p for p in (self.spool / "rejected").glob("*") if not p.name.startswith(".")),
        ]


async def stop(proc: subprocess.Popen[bytes], how: signal.Signals) -> None:
    proc.send_signal(how)
    code = await asyncio.to_thread(proc.wait, 30)
    assert code == (0 if how == signal.SIGTERM else -how), code


def xid_unhealthy(status: dict[str, Any] | None, index: int) -> bool:
    if status is None:
        return False
    gpu = next((g for g in status["health"]["gpus"] if g["index"] == index), None)
    return gpu is not None and gpu["checks"]["xid"]["state"] == "unhealthy"


def latched_codes(doc: dict[str, Any], uuid: str) -> list[int]:
    return [item["code"] for item in doc.get("gpus", {}).get(uuid, {}).get("latched", [])]


def gauges(text: str, name: str) -> dict[str, float]:
    """A gauge's samples by their one label's value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[next(iter(sample.labels.values()))] = sample.value
    return found


def digests(paths: list[Path]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


async def until(check: Callable[[], bool], what: str, within: float = 60) -> None:
    await eventually(check, within=within, what=what)


@pytest.mark.timeout(600)  # the first run builds the previous release (about a minute)
async def test_upgrade_from_the_previous_release_and_roll_back_from_the_next(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    previous = await asyncio.to_thread(release_agent)
    newer = newer_copy(tmp_path / "newer")
    gpus = [g.uuid for g in gb200x4(NODE)]
    socket_dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))
    kubelet = FakeKubelet(str(socket_dir / "kubelet.sock"), allocatable=((GPU, tuple(gpus)),))
    await kubelet.start()
    node = Node(tmp_path, subprocess_env, kubelet)
    train: KubeletPod = pod("ml", "train-0", "main", GPU, gpus[0])
    kubelet.pods = [train, pod("ml", "done-0", "main", GPU, gpus[1])]
    this_version = [sys.executable, "-m", "gpuid_agent"]
    newer_version = dict(cwd=newer, PYTHONPATH=str(newer))
    proc: subprocess.Popen[bytes] | None = None
    try:
        # ---- the previous release, sink dead: a backlog, two open allocations, a latched XID
        proc = node.start("previous", [str(previous)], cwd=tmp_path, FAULT="xid79:gpu2")

        def previous_holds_it_all() -> bool:
            kinds = node.spooled_kinds()
            return (
                len(node.state_doc(formats.ALLOCATIONS).get("open", [])) == 2
                and latched_codes(node.state_doc(formats.HEALTH), gpus[2]) == [79]
                and kinds["reading"] >= 4
                and kinds["allocation start"] == 2
                and kinds["health"] >= 1
            )

        await until(previous_holds_it_all, "the previous release's backlog and state")
        assert xid_unhealthy(await node.status(), 2)
        await stop(proc, signal.SIGKILL)
        left = [i for ids in node.spooled().values() for i in ids] + node.owed()
        saved_at = node.state_doc(formats.ALLOCATIONS)["saved_at"]

        # ---- this version on the same directories, sink alive, done-0 gone meanwhile
        kubelet.pods = [train]
        await node.sink.start()
        proc = node.start("upgraded", this_version, cwd=Path.cwd())
        await until(
            lambda: (
                set(left) <= set(node.sink.counts())
                and node.sink.allocation_events("done-0", "end")
            ),
            "the previous release's records and done-0's end",
        )
        assert xid_unhealthy(await node.status(), 2)  # no XID since: the latch came along
        await stop(proc, signal.SIGTERM)
        received = node.sink.counts()
        assert {i: received[i] for i in left} == dict.fromkeys(left, 1)
        assert len(node.sink.allocation_events("train-0", "start")) == 1  # continued
        assert node.sink.allocation_events("train-0", "end") == []
        [end] = node.sink.allocation_events("done-0", "end")
        assert end["end_observed"] is False and end["last_seen_at"] == saved_at
        assert latched_codes(node.state_doc(formats.HEALTH), gpus[2]) == [79]
        for name in STATE_FILES:  # each rewritten in this version's format
            assert node.state_doc(name)["version"] == formats.FORMATS[name], name
        assert node.spooled() == {} and node.set_aside() == []

        # ---- the next version, sink dead: files of its formats, a spooled backlog
        await node.sink.stop()
        kubelet.pods = [train, pod("ml", "new-0", "main", GPU, gpus[1])]
        replaced = "gpu-replaced:gpu3"  # a board swapped while it runs: hardware.json owes one
        proc = node.start("newer", this_version, **newer_version, FAULT=replaced)

        def newer_wrote_everything() -> bool:
            spooled = node.spooled()
            return (
                all(
                    node.state_doc(name).get("version") == formats.FORMATS[name] + 1
                    for name in STATE_FILES
                )
                and not node.owed()
                and bool(spooled)
                and all(".v2." in name for name in spooled)
            )

        await until(newer_wrote_everything, "the newer version's state files and spool")
        await stop(proc, signal.SIGKILL)
        newer_ids = [i for ids in node.spooled().values() for i in ids]
        newer_files = sorted([*(node.state / n for n in STATE_FILES), *spool_files(node.spool)])
        before = digests(newer_files)

        # ---- this version again (a rollback), sink alive: the newer files stay, untouched
        await node.sink.start()
        kubelet.pods = [train]  # new-0 ends while this version runs without the newer trail
        start_count = len(node.sink.records)
        proc = node.start("rolled-back", this_version, cwd=Path.cwd(), FAULT=replaced)
        await until(
            lambda: any(r.get("kind") == "reading" for r in node.sink.records[start_count:]),
            "this version delivering its own readings",
        )
        status = await node.status()
        assert status is not None
        for name in STATE_FILES:
            kept = status["components"][f"state:{name}"]
            assert kept["state"] == "degraded", kept
            assert f"format {formats.FORMATS[name] + 1}, newer" in kept["reason"], kept
        [exporter] = status["exporters"]
        assert exporter["newer_format_batches"] == len(node.spooled())
        metrics = await node.get("/metrics")
        assert gauges(metrics, "gpuid_state_files_newer") == dict.fromkeys(STATE_FILES, 1.0)
        assert gauges(metrics, "gpuid_spool_newer_batches") == {"http": len(node.spooled())}
        # A hold, no wait: it proves no save overwrites a newer file and no newer batch goes
        # out while this version runs (the trail and accounting save within a second or two).
        await asyncio.sleep(3)
        await stop(proc, signal.SIGTERM)
        assert digests(newer_files) == before
        assert node.set_aside() == []
        assert not set(newer_ids) & set(node.sink.counts())
        said = [line["msg"] for line in node.log("rolled-back")]
        for name in STATE_FILES:
            assert said.count(f"state:{name} is degraded") == 1, said
        kept_batches = [m for m in said if m.startswith("spool holds batches of a newer format")]
        assert len(kept_batches) == 1, said

        # ---- the newer version again: its files read, its backlog delivered exactly once
        proc = node.start("newer-again", this_version, **newer_version, FAULT=replaced)
        await until(
            lambda: (
                set(newer_ids) <= set(node.sink.counts())
                and node.sink.allocation_events("new-0", "end")
            ),
            "the newer version's backlog and new-0's end",
        )
        assert xid_unhealthy(await node.status(), 2)  # its health.json still holds the latch
        await stop(proc, signal.SIGTERM)
        received = node.sink.counts()
        assert {i: received[i] for i in newer_ids} == dict.fromkeys(newer_ids, 1)
        [end] = node.sink.allocation_events("new-0", "end")
        assert end["end_observed"] is False
        assert node.spooled() == {} and node.set_aside() == []
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        await node.sink.stop()
        await kubelet.stop()
