"""/gpu/metrics scrape latency at 1,024 pods against a static-bytes aiohttp server.

The real app serves a rendered 1,024-pod snapshot from a process of its own, as the static
server (agentproc.start_static) serves the same bytes from another; both are loaded in
interleaved rounds, so drift in the machine's load hits both. dcgm naming is scraped as text
(its only format), Prometheus naming as OpenMetrics (what Prometheus negotiates by default,
made on the first scrape of a snapshot and shared by the rest).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from benchmarks.agentproc import free_port, load, start_static, stop, wait_http
from benchmarks.bench_serving import PODS, _Healthy, snapshot
from benchmarks.common import Row, percentile
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.app import OPENMETRICS, build_app
from gpuid_agent.serving.renderer import MetricsRenderer

SERVE = """
import asyncio, sys
from benchmarks.bench_scrape import serve_snapshot
asyncio.run(serve_snapshot(int(sys.argv[1]), sys.argv[2]))
"""
# (naming, Accept header, clients, requests per round): the dcgm body is ~9 MB
CASES: tuple[tuple[gpu_metrics.Naming, str, int, int], ...] = (
    ("dcgm", "text/plain", 8, 100),
    ("prometheus", OPENMETRICS, 32, 500),
)
ROUNDS = 3
GOAL = 1.5


async def serve_snapshot(port: int, naming: gpu_metrics.Naming) -> None:
    """The agent's app serving one 1,024-pod snapshot until killed (rendered by the first
    scrape, in the warm-up)."""
    renderer = MetricsRenderer(naming, (), object())
    renderer.offer(snapshot(1))
    app = build_app(_Healthy(), renderer, CollectorRegistry(auto_describe=False))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def _start(port: int, naming: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", SERVE, str(port), naming],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _case(naming: gpu_metrics.Naming, accept: str, clients: int, requests: int) -> list[Row]:
    headers = {"Accept": accept}
    port, sport = free_port(), free_port()
    ours = _start(port, naming)
    try:
        url = f"http://127.0.0.1:{port}/gpu/metrics"
        await wait_http(url, within=120)
        async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
            body = await resp.read()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "body"
            path.write_bytes(body)
            static = start_static(sport, path)
            try:
                surl = f"http://127.0.0.1:{sport}/gpu/metrics"
                await wait_http(surl)
                await load(surl, clients, requests // 2, headers)  # warm-up both
                await load(url, clients, requests // 2, headers)
                base: list[float] = []
                mine: list[float] = []
                for _ in range(ROUNDS):
                    base += await load(surl, clients, requests, headers)
                    mine += await load(url, clients, requests, headers)
            finally:
                stop(static)
    finally:
        stop(ours)
    p99, b99 = percentile(mine, 99) * 1000, percentile(base, 99) * 1000
    fmt = "OpenMetrics" if accept == OPENMETRICS else "text"
    name = f"scrape {PODS:,} pods {naming} {fmt}"
    note = f"{len(body):,} B, {clients} clients, {len(mine)} requests"
    return [
        Row("serving", f"{name} p99", p99, "ms", note),
        Row("serving", f"{name}: static bytes p99", b99, "ms", "same body, same run"),
        Row("serving", f"{name} p99 / static p99", p99 / b99, "x", f"goal ≤ {GOAL:g}"),
    ]


async def run() -> list[Row]:
    rows: list[Row] = []
    for case in CASES:
        rows += await _case(*case)
    return rows
