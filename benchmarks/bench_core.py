"""Core agent: /gpu/metrics scrape latency vs static bytes, RSS vs import floor, start-to-ready."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.agentproc import (
    free_port,
    load,
    rss_mib,
    start_agent,
    start_static,
    stop,
    wait_http,
)
from benchmarks.common import Row, percentile

IMPORTED = """
import sys
import gpuid_agent.agent, gpuid_agent.cli, gpuid_agent.simulate.nvml_backend
print("\\n".join(sorted(m for m in sys.modules if not m.startswith(("gpuid_agent", "__main__")))))
"""
FLOOR = """
import importlib, sys, time
for name in sys.stdin.read().split():
    try:
        importlib.import_module(name)
    except Exception:
        pass
print("ready", flush=True)
time.sleep(600)
"""


def _import_floor_rss() -> float:
    """RSS of a process that imports exactly the modules the agent imports, and nothing else."""
    names = subprocess.run(
        [sys.executable, "-c", IMPORTED], capture_output=True, text=True, check=True
    ).stdout
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin and proc.stdout
    proc.stdin.write(names)
    proc.stdin.close()
    proc.stdout.readline()
    try:
        return rss_mib(proc.pid)
    finally:
        proc.kill()
        proc.wait()


async def run() -> list[Row]:
    rows: list[Row] = []
    port = free_port()
    started = time.perf_counter()
    agent = start_agent(port, "--simulate", "h100x8", "--collect-interval", "1s")
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz")
        ready = time.perf_counter() - started
        await asyncio.sleep(1.5)
        rss = rss_mib(agent.pid)
        url = f"http://127.0.0.1:{port}/gpu/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            body = await resp.read()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "body"
            path.write_bytes(body)
            sport = free_port()
            static = start_static(sport, path)
            try:
                await wait_http(f"http://127.0.0.1:{sport}/gpu/metrics")
                surl = f"http://127.0.0.1:{sport}/gpu/metrics"
                await load(surl, requests=500)  # warm-up both
                await load(url, requests=500)
                base: list[float] = []
                ours: list[float] = []
                for _ in range(3):  # interleaved rounds, so drift in machine load hits both
                    base += await load(surl, requests=1000)
                    ours += await load(url, requests=1000)
            finally:
                stop(static)
        rss_after = rss_mib(agent.pid)
    finally:
        stop(agent)
    floor = _import_floor_rss()
    p50, p99 = percentile(ours, 50) * 1000, percentile(ours, 99) * 1000
    b50, b99 = percentile(base, 50) * 1000, percentile(base, 99) * 1000
    note = f"{len(body)} B body, 32 clients, {len(ours)} requests"
    rows += [
        Row("core", "/gpu/metrics p50", p50, "ms", note),
        Row("core", "/gpu/metrics p99", p99, "ms", note),
        Row("core", "static-bytes handler p50", b50, "ms", "same body, same run"),
        Row("core", "static-bytes handler p99", b99, "ms", "same body, same run"),
        Row("core", "scrape p99 / static p99", p99 / b99, "x", "goal ≤ 1.5"),
        Row("core", "agent RSS after start", rss, "MiB", "simulated h100x8"),
        Row("core", "agent RSS after load", rss_after, "MiB", ""),
        Row("core", "import floor RSS", floor, "MiB", "same modules imported, nothing run"),
        Row("core", "RSS above import floor", rss - floor, "MiB", "goal ≤ 20"),
        Row("core", "start to ready", ready * 1000, "ms", "process spawn to /readyz 200"),
    ]
    return rows
