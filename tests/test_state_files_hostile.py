"""Whatever sits at a state file's or a spooled batch's path, the agent (a real process) starts,
serves and stops: a FIFO is never opened, a symlink never followed (to /dev/zero, or out of
STATE_DIR), a huge file never read; each is moved into `rejected/` and counted. And SIGTERM
ends an agent whose start is blocked on a file.

Run with -s to see the measured figures (time to /readyz, SIGTERM to exit); the memory of an
agent over such files is `python -m benchmarks state_files`'s."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.delivery.spool_files import MAX_BATCH_FILE_BYTES, SpoolFiles
from gpuid_agent.runtime.errors import CorruptBatchError
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.state.gpu_slots import GpuSlots
from gpuid_agent.state.state_file import MAX_STATE_FILE_BYTES, StateDir
from tests.servers.receiver import Receiver
from tests.waiting import eventually

GRACE = 2.0
REJECTED = "gpuid_state_files_rejected_total"
GOLDEN_BATCH = Path(__file__).parent / "data" / "wire_golden" / "spool-ndjson.bin"


def started_port(log: Path) -> int | None:
    for line in log.read_text(errors="replace").splitlines():
        if '"agent started"' in line:
            return int(json.loads(line)["port"])
    return None


class Agent:
    """`gpuid-agent run` as a subprocess; stderr (the log) and stdout in files."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str) -> None:
        self.log, self.out = tmp_path / "agent.log", tmp_path / "stdout"
        env = env | {
            "SERVER_ADDRESS": "127.0.0.1",
            "SERVER_PORT": "0",
            "LABELS": "off",
            "KUBE_API": "off",
            "LOG_LEVEL": "info",
            "SHUTDOWN_GRACE": str(GRACE),
        }
        with open(self.log, "ab") as err, open(self.out, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gpuid_agent", "run", *args],
                env=env,
                stdout=out,
                stderr=err,
            )
        self.started = time.monotonic()
        self.base = ""

    async def ready(self) -> float:
        """Seconds from the start to /readyz answering 200."""
        port = await eventually(
            lambda: self.proc.poll() is None and started_port(self.log), within=60
        )
        self.base = f"http://127.0.0.1:{port}"

        async def ready() -> bool:
            async with aiohttp.ClientSession() as http, http.get(self.base + "/readyz") as r:
                return r.status == 200

        await eventually(ready, within=60, ignoring=(aiohttp.ClientError,))
        return time.monotonic() - self.started

    async def counters(self, name: str) -> dict[tuple[str, ...], float]:
        async with aiohttp.ClientSession() as http, http.get(self.base + "/metrics") as r:
            text = await r.text()
        return {
            tuple(s.labels.values()): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        }

    async def terminate(self) -> float:
        """SIGTERM; the seconds until the process exited (with status 0)."""
        self.proc.send_signal(signal.SIGTERM)
        term_at = time.monotonic()
        code = await asyncio.to_thread(self.proc.wait, GRACE + 20)
        assert code == 0, self.log.read_text(errors="replace")[-2000:]
        return time.monotonic() - term_at

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# every file the agent keeps under STATE_DIR
STATE_FILES = ("allocations.json", "hardware.json", "health.json", "accounting.json")


def rejected(directory: Path) -> dict[str, os.stat_result]:
    """What `rejected/` holds, by the name each entry had (lstat: links are not followed)."""
    return {p.name.split(".")[0] + ".json": p.lstat() for p in (directory / "rejected").iterdir()}


async def test_fifos_as_state_files_and_odd_spool_files_are_set_aside(
    receiver: Receiver, subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    state, spool = tmp_path / "state", tmp_path / "spool"
    state.mkdir()
    for file in STATE_FILES:
        os.mkfifo(state / file)
    lines = GOLDEN_BATCH.read_bytes().splitlines(keepends=True)
    good, elsewhere = lines[:5], lines[5:]
    http = spool / "http"
    http.mkdir(parents=True)
    now = time.time_ns()

    def batch_name(n: int, count: int) -> str:
        return f"{now - 10**9 + n:020d}-{n:032x}-{count}.ndjson"

    (http / batch_name(1, len(good))).write_bytes(b"".join(good))
    odd = {
        batch_name(2, 1): "fifo",
        batch_name(3, 1): "zero",
        batch_name(4, 1): "huge",
        batch_name(5, len(elsewhere)): "outside",
    }
    names = {why: name for name, why in odd.items()}
    os.mkfifo(http / names["fifo"])
    os.symlink("/dev/zero", http / names["zero"])
    (http / names["huge"]).touch()
    os.truncate(http / names["huge"], MAX_BATCH_FILE_BYTES + 1)  # sparse: no disk used
    outside = tmp_path / "outside.ndjson"
    outside.write_bytes(b"".join(elsewhere))
    os.symlink(outside, http / names["outside"])
    env = subprocess_env | {
        "STATE_DIR": str(state),
        "SPOOL_DIR": str(spool),
        "EXPORTER_TYPE": "http",
        "HTTP_ENDPOINT": receiver.url,
    }
    agent = Agent(tmp_path, env, "--simulate", "gb200x4")
    try:
        to_ready = await agent.ready()
        counted = await agent.counters(REJECTED)
        for file in STATE_FILES:
            assert counted[(file, "not_regular")] == 1
            assert counted[(file, "symlink")] == 0  # every reason's series is there at 0
        set_aside = rejected(state)
        assert set_aside.keys() == set(STATE_FILES)
        assert all(stat.S_ISFIFO(s.st_mode) for s in set_aside.values())
        # the next save writes a regular file at the path
        await eventually(lambda: (state / "hardware.json").is_file())

        good_ids = {json.loads(line)["record_id"] for line in good}
        await eventually(lambda: good_ids <= receiver.accepted_ids(), within=30)
        kept = {p.name: p.lstat() for p in (http / "rejected").iterdir()}
        assert kept.keys() == set(odd)
        assert stat.S_ISFIFO(kept[names["fifo"]].st_mode)
        assert os.readlink(http / "rejected" / names["zero"]) == "/dev/zero"
        assert kept[names["huge"]].st_size == MAX_BATCH_FILE_BYTES + 1
        assert os.readlink(http / "rejected" / names["outside"]) == str(outside)
        assert outside.read_bytes() == b"".join(elsewhere)
        elsewhere_ids = {json.loads(line)["record_id"] for line in elsewhere}
        assert not elsewhere_ids & receiver.accepted_ids()  # never followed, never sent
        to_exit = await agent.terminate()
        print(f"\nFIFO state files: /readyz after {to_ready:.2f}s; SIGTERM to exit {to_exit:.2f}s")
    finally:
        agent.close()


async def test_symlinks_as_state_files_are_not_followed(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.symlink("/dev/zero", state / "hardware.json")
    secret = tmp_path / "etc" / "passwd"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0:root:/root:/bin/bash\nsvc:x:1:1:token-d2f1e8b0:/:/bin/sh\n")
    before = secret.read_bytes(), secret.stat().st_mtime_ns
    os.symlink(secret, state / "allocations.json")
    agent = Agent(tmp_path, subprocess_env | {"STATE_DIR": str(state)}, "--simulate", "gb200x4")
    try:
        to_ready = await agent.ready()
        counted = await agent.counters(REJECTED)
        for file in ("allocations.json", "hardware.json"):
            assert counted[(file, "symlink")] == 1
        # set aside unread: the links themselves, still pointing where they pointed
        links = {p.name.split(".")[0]: os.readlink(p) for p in (state / "rejected").iterdir()}
        assert links == {"hardware": "/dev/zero", "allocations": str(secret)}
        # the simulated node's pods open allocations: the trail saves a regular file
        await eventually(lambda: (state / "allocations.json").is_file())
        await eventually(lambda: (state / "hardware.json").is_file())
        assert not (state / "allocations.json").is_symlink()
        assert (secret.read_bytes(), secret.stat().st_mtime_ns) == before
        to_exit = await agent.terminate()
        for written in (agent.log, agent.out):
            text = written.read_text(errors="replace")
            assert "root:x" not in text and "token-d2f1e8b0" not in text
        print(
            f"\n/dev/zero as hardware.json: /readyz after {to_ready:.2f}s; SIGTERM to exit {to_exit:.2f}s"
        )
    finally:
        agent.close()


def test_a_huge_or_odd_state_file_starts_empty(tmp_path: Path) -> None:
    metrics = AgentMetrics()
    state_dir = StateDir(str(tmp_path), metrics.state_files_rejected)
    path = tmp_path / "hardware.json"
    path.touch()
    os.truncate(path, MAX_STATE_FILE_BYTES + 1)
    slots = GpuSlots(state_dir)
    assert slots.serials is None and not path.exists()
    [(kept, info)] = rejected(tmp_path).items()
    assert kept == "hardware.json" and info.st_size == MAX_STATE_FILE_BYTES + 1
    path.mkdir()  # a directory at the path
    assert GpuSlots(state_dir).serials is None and not path.exists()
    value = metrics.registry.get_sample_value
    for reason in ("too_large", "not_regular"):
        assert value(REJECTED, {"file": "hardware.json", "reason": reason}) == 1


def test_a_rejected_dir_that_leads_out_of_state_dir_is_not_used(tmp_path: Path) -> None:
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    state.mkdir()
    elsewhere.mkdir()
    (state / "rejected").symlink_to(elsewhere)
    (state / "hardware.json").write_bytes(b"not json")
    assert GpuSlots(StateDir(str(state))).serials is None
    assert list(elsewhere.iterdir()) == []
    assert (state / "hardware.json").read_bytes() == b"not json"  # the next save replaces it


def test_a_batch_file_swapped_after_the_index_fails_its_read_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.ndjson")
    os.symlink("/dev/zero", tmp_path / "zero.ndjson")
    (tmp_path / "huge.ndjson").touch()
    os.truncate(tmp_path / "huge.ndjson", MAX_BATCH_FILE_BYTES + 1)
    for name, why in (("fifo", "a FIFO"), ("zero", "a symlink"), ("huge", "over")):
        path = tmp_path / f"{name}.ndjson"
        with pytest.raises(CorruptBatchError, match=why):
            SpoolFiles.read([path])
        with pytest.raises(CorruptBatchError, match=why):
            SpoolFiles.read_records(path, 1)


def open_writer(fifo: Path) -> int | None:
    """A write end of `fifo` once something has it open for reading (or waits to)."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no reader yet
            return None
        raise


async def test_sigterm_while_the_start_is_blocked_on_a_file(
    subprocess_env: dict[str, str], tmp_path: Path
) -> None:
    """The machine identity is read while the agent is built; a FIFO there blocks that read
    (a hung mount would too). SIGTERM still ends the agent at once, with status 0."""
    fifo = tmp_path / "product_uuid"
    os.mkfifo(fifo)
    env = subprocess_env | {
        "DMI_PRODUCT_UUID_PATH": str(fifo),
        "NVML_LIBRARY_PATH": str(tmp_path / "no-libnvidia-ml.so.1"),
        "POD_RESOURCES_SOCKET": str(tmp_path / "no-kubelet.sock"),
    }
    agent = Agent(tmp_path, env)
    writer: int | None = None
    try:
        # held open and never written: the agent's read waits for data that never comes
        writer = await eventually(lambda: open_writer(fifo), within=60, what="the agent reading")
        assert agent.proc.poll() is None and started_port(agent.log) is None
        to_exit = await agent.terminate()
        log = agent.log.read_text(errors="replace")
        assert "stopped while starting" in log and "Traceback" not in log
        print(f"\nSIGTERM to exit with the start blocked on a FIFO: {to_exit:.2f}s")
        assert to_exit < GRACE + 5  # landed main ignored SIGTERM here (> 40 s, then SIGKILL)
    finally:
        if writer is not None:
            os.close(writer)
        agent.close()
