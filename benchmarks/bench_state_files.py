"""Memory of an agent whose state files are hostile (the figure tests/test_state_files_hostile.py
once asserted): peak RSS (VmHWM) and time to /readyz of `gpuid-agent run --simulate gb200x4`
with every state file a symlink to /dev/zero, a FIFO, or a sparse file one byte over the
limit, beside the same agent on an empty STATE_DIR (the floor). Each file is set aside
unread, so each case should sit at the floor; the goal is under 512 MiB (a version that read
/dev/zero grew to 2.6 GB, then died of MemoryError). BENCH_STATE_SETTLE_SECONDS (default 3)
is how long the agent runs after /readyz before its peak is read.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.agentproc import free_port, start_agent, stop, wait_http
from benchmarks.common import Row
from gpuid_agent.runtime.formats import STATE_FILES
from gpuid_agent.state.state_file import MAX_STATE_FILE_BYTES

ROOT = str(Path(__file__).resolve().parent.parent)
SETTLE = float(os.environ.get("BENCH_STATE_SETTLE_SECONDS", "3"))
GOAL_MIB = 512


def _symlink_to_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _over_the_limit(path: Path) -> None:
    path.touch()
    os.truncate(path, MAX_STATE_FILE_BYTES + 1)


CASES: dict[str, Callable[[Path], None] | None] = {
    "empty STATE_DIR (floor)": None,
    "symlinks to /dev/zero": _symlink_to_zero,
    "FIFOs": _fifo,
    "one byte over the size limit": _over_the_limit,
}


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def _case(make: Callable[[Path], None] | None) -> tuple[float, float]:
    """Seconds to /readyz and peak RSS (MiB) of one agent over a STATE_DIR made by `make`."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        for name in STATE_FILES if make else ():
            make(state / name)
        port = free_port()
        env = {"STATE_DIR": str(state), "NODE_NAME": "node-a", "PYTHONPATH": ROOT}
        proc = start_agent(port, "--simulate", "gb200x4", env=env)
        try:
            ready = await wait_http(f"http://127.0.0.1:{port}/readyz", within=60)
            await asyncio.sleep(SETTLE)  # the first saves replace the set-aside files meanwhile
            peak = peak_rss_mib(proc.pid)
        finally:
            stop(proc)
        set_aside = len(list((state / "rejected").iterdir())) if make else 0
        if set_aside != (len(STATE_FILES) if make else 0):
            raise RuntimeError(f"{set_aside} state files set aside, not every one")
        return ready, peak


async def run() -> list[Row]:
    rows: list[Row] = []
    for label, make in CASES.items():
        ready, peak = await _case(make)
        note = "" if make is None else f"goal < {GOAL_MIB} MiB"
        rows.append(Row("state files", f"peak RSS, {label}", peak, "MiB", note))
        rows.append(Row("state files", f"to /readyz, {label}", ready, "s"))
    return rows
