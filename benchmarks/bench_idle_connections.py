"""10,000 idle TCP connections against the agent's HTTP port (a simulated node).

Row set "default limit": the agent with its default settings and this machine's descriptor
limit; the connections are opened and held without sending a byte. Reports the agent's peak
descriptors (/proc/PID/fd) and the seconds, after the last connection was opened, until the
descriptors are back near where they started (bounded by WAIT_CLOSE).

Row set "ulimit -n 1024": the agent started with RLIMIT_NOFILE 1024 while the same 10,000
connections are opened and held for HOLD seconds; /healthz is asked on a fresh connection every
half second with the chart's liveness timeout (PROBE_TIMEOUT), then once more with all of them
still open, and the agent's warning and error log lines are counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.agentproc import free_port, rss_mib, stop
from benchmarks.common import Row

CONNECTIONS = 10_000
CONNECT_CONCURRENCY = 500
CONNECT_TIMEOUT = 3.0
WAIT_CLOSE = 90.0
HOLD = 13.0
PROBE_TIMEOUT = 5.0  # the chart's livenessProbe.timeoutSeconds


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _start(port: int, log: Path, nofile: int | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.isupper() or k in ("PATH", "HOME")}
    env |= {
        "SERVER_ADDRESS": "127.0.0.1",
        "SERVER_PORT": str(port),
        "SIMULATE": "h100x8",
        "LABELS": "off",
        "KUBE_API": "off",
        "LOG_LEVEL": "info",
    }
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuid_agent", "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    if nofile is not None:  # `ulimit -n`, set before the agent has opened its server
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
    return proc


async def _healthz(port: int, within: float = 2.0) -> int | None:
    """The status code of GET /healthz on a fresh connection, None when none came in time."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), within)
    except (OSError, TimeoutError):
        return None
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), within)
        return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else None
    except (OSError, TimeoutError, ValueError, IndexError):
        return None
    finally:
        writer.close()


async def _wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while await _healthz(port) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the agent did not start")
        await asyncio.sleep(0.1)


async def _open_idle(port: int, count: int) -> list[socket.socket]:
    """`count` connections that send nothing; those not connected in time are dropped."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
    held: list[socket.socket] = []

    async def one() -> None:
        async with gate:
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await asyncio.wait_for(
                    loop.sock_connect(sock, ("127.0.0.1", port)), CONNECT_TIMEOUT
                )
            except (OSError, TimeoutError):
                sock.close()
                return
            held.append(sock)

    await asyncio.gather(*(one() for _ in range(count)))
    return held


def _close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()


def _log_lines(log: Path) -> tuple[int, int]:
    """Warning-or-worse lines and lines carrying a traceback."""
    lines = log.read_text(errors="replace").splitlines()
    loud = [x for x in lines if '"level":"warning"' in x or '"level":"error"' in x]
    return len(loud), sum('"exc":' in x for x in lines)


async def _default_limit(tmp: Path) -> list[Row]:
    port, log = free_port(), tmp / "default.log"
    proc = _start(port, log, None)
    try:
        await _wait_up(port, proc)
        base_fds, base_rss = _fds(proc.pid), rss_mib(proc.pid)
        held = await _open_idle(port, CONNECTIONS)
        opened = time.monotonic()
        await asyncio.sleep(1.0)
        peak, rss = _fds(proc.pid), rss_mib(proc.pid)
        answered = await _healthz(port)
        closed_after: float | None = None
        while time.monotonic() - opened < WAIT_CLOSE:
            fds = _fds(proc.pid)
            peak = max(peak, fds)
            if fds <= base_fds + 16:
                closed_after = time.monotonic() - opened
                break
            await asyncio.sleep(0.25)
        _close_all(held)
        loud, tracebacks = _log_lines(log)
    finally:
        stop(proc)
    group = "idle connections"
    return [
        Row(group, "connected (default limit)", len(held), "conns", f"of {CONNECTIONS:,}"),
        Row(group, "agent fds held, peak", peak, "fds", f"{base_fds} before the flood"),
        Row(group, "agent RSS growth", rss - base_rss, "MiB", "1 s after the last connect"),
        Row(
            group,
            "idle ones closed after",
            closed_after if closed_after is not None else -1,
            "s",
            "since the last connect" if closed_after is not None else f"not in {WAIT_CLOSE:.0f} s",
        ),
        Row(group, "/healthz during the flood", answered or 0, "code", "0: no answer in 2 s"),
        Row(
            group, "warning+error lines (default limit)", loud, "lines", f"{tracebacks} tracebacks"
        ),
    ]


async def _low_limit(tmp: Path) -> list[Row]:
    port, log = free_port(), tmp / "ulimit.log"
    proc = _start(port, log, 1024)
    try:
        await _wait_up(port, proc)
        started = time.monotonic()
        flood = asyncio.create_task(_open_idle(port, CONNECTIONS))
        answers: list[int | None] = []
        peak = 0
        while time.monotonic() - started < HOLD:
            answers.append(await _healthz(port, PROBE_TIMEOUT))
            peak = max(peak, _fds(proc.pid))
            await asyncio.sleep(0.5)
        held = await flood
        peak = max(peak, _fds(proc.pid))
        after = await _healthz(port, PROBE_TIMEOUT)
        _close_all(held)
        loud, tracebacks = _log_lines(log)
        alive = proc.poll() is None
    finally:
        stop(proc)
    group = "idle connections, ulimit -n 1024"
    ok = sum(a == 200 for a in answers)
    return [
        Row(group, "connected", len(held), "conns", f"of {CONNECTIONS:,}"),
        Row(group, "agent fds held, peak", peak, "fds", "limit 1024"),
        Row(group, "/healthz answered 200", ok, "probes", f"of {len(answers)} in {HOLD:.0f} s"),
        Row(group, "/healthz with all held", after or 0, "code", "0: no answer in 5 s"),
        Row(group, "warning+error lines", loud, "lines", f"{tracebacks} tracebacks"),
        Row(group, "agent still running", int(alive), "bool"),
    ]


async def run() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = await _default_limit(Path(tmp))
        rows += await _low_limit(Path(tmp))
    return rows
