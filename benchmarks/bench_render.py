"""/gpu/metrics rendered when scraped: the agent's CPU and its scrape latency beside a baseline
checkout, both measured in the same run.

The baseline (`--render-baseline=REV`, default BASELINE: the last commit that rendered every
snapshot as it arrived) is extracted with `git archive` into a temporary directory and started
from there; both agents run at the same time against the same kubelet (and API server), so
whatever else loads the machine loads both alike.

- CPU at the chart's defaults (8 GPUs, the API on, 10 s collection, 5 s pod-resources poll,
  scraped every 30 s as the chart's ServiceMonitor does) over BENCH_RENDER_CPU_SECONDS
  (default 180), and at COLLECT_INTERVAL=1s over BENCH_CPU_SECONDS (default 60).
- Scrape latency: each agent scraped every 2 s, as a scraper with a steady interval does, over
  BENCH_RENDER_SCRAPE_SECONDS (default 120; the first 5 scrapes are a warm-up): at the chart's
  defaults in OpenMetrics (what Prometheus negotiates), and at 1,024 pods from a gRPC kubelet
  with dcgm naming (text; the heaviest page) at 1 s collection. The two agents' scrapes are
  half an interval apart, so neither waits on the other's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from benchmarks.agentproc import free_port, start_agent, stop, wait_http
from benchmarks.bench_footprint import (
    DEFAULTS,
    PODS,
    ROOT,
    WARMUP,
    _scrape,
    _start_kubelet,
    chart_node,
    cpu_seconds,
)
from benchmarks.common import Row, percentile
from gpuid_agent.serving.app import OPENMETRICS

BASELINE = "484bfadae08c370174af336ac1bc5dcdebe67dfc"
CPU_SECONDS = float(os.environ.get("BENCH_RENDER_CPU_SECONDS", "180"))
CPU_1S_SECONDS = float(os.environ.get("BENCH_CPU_SECONDS", "60"))
SCRAPE_SECONDS = float(os.environ.get("BENCH_RENDER_SCRAPE_SECONDS", "120"))
SCRAPE_EVERY = 2.0
SKIPPED = 5  # first scrapes of each agent: the warm-up, and the scraper's cadence learnt
GOAL = 0.12  # % of a core at the chart's defaults


def _baseline_rev() -> str:
    for arg in sys.argv[1:]:
        if arg.startswith("--render-baseline="):
            return arg.split("=", 1)[1]
    return BASELINE


@contextmanager
def _checkout(rev: str) -> Iterator[str | None]:
    """The package as of `rev` in a temporary directory (None: git cannot give it)."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", rev, "gpuid_agent"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bench-render-baseline-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        yield tmp


class Pair:
    """This tree's agent and the baseline's, started alike."""

    def __init__(self, baseline: str, env: dict[str, str]) -> None:
        self.ports = {"this tree": free_port(), "baseline": free_port()}
        roots = {"this tree": ROOT, "baseline": baseline}
        self.procs = {
            name: start_agent(
                port, env=DEFAULTS | env | {"PYTHONPATH": roots[name]}, cwd=roots[name]
            )
            for name, port in self.ports.items()
        }

    def base(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def ready(self) -> None:
        for name in self.ports:
            await wait_http(f"{self.base(name)}/readyz", within=120)

    def cpu(self) -> dict[str, float]:
        return {name: cpu_seconds(proc.pid) for name, proc in self.procs.items()}

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


async def _renders(base: str) -> float:
    """Renders this tree's agent counted (gpuid_gpu_metrics_render_duration_seconds)."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    prefix = "gpuid_gpu_metrics_render_duration_seconds_count"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


async def _cpu(baseline: str, env: dict[str, str], seconds: float, label: str) -> list[Row]:
    pair = Pair(baseline, env)
    try:
        await pair.ready()
        await asyncio.sleep(WARMUP)
        before, started = pair.cpu(), time.monotonic()
        renders = await _renders(pair.base("this tree"))
        await asyncio.gather(*(_scrape(pair.base(n), 30.0, started + seconds) for n in pair.ports))
        elapsed = time.monotonic() - started
        used = {n: (s - before[n]) / elapsed * 100 for n, s in pair.cpu().items()}
        renders = await _renders(pair.base("this tree")) - renders
    finally:
        pair.close()
    note = f"over {elapsed:.0f} s, both at once, scraped every 30 s"
    goal = f"; goal <= {GOAL:g} %" if "10 s" in label else ""
    return [
        Row("render", f"CPU {label}: this tree", used["this tree"], "% of a core",
            f"{note}{goal}; {renders:.0f} renders"),
        Row("render", f"CPU {label}: baseline", used["baseline"], "% of a core",
            f"{note}; a render per snapshot"),
    ]  # fmt: skip


async def _scrapes(url: str, headers: dict[str, str], offset: float) -> list[float]:
    """Milliseconds of each scrape of `url`, every SCRAPE_EVERY from `offset` on."""
    took: list[float] = []
    async with aiohttp.ClientSession() as http:
        start = time.monotonic() + offset
        n = 0
        while (due := start + n * SCRAPE_EVERY) < start + SCRAPE_SECONDS:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            began = time.perf_counter()
            async with http.get(url, headers=headers) as resp:
                await resp.read()
            took.append((time.perf_counter() - began) * 1000)
            n += 1
    return took[SKIPPED:]


async def _latency(baseline: str, env: dict[str, str], accept: str, label: str) -> list[Row]:
    pair = Pair(baseline, env)
    try:
        await pair.ready()
        await asyncio.sleep(WARMUP)
        headers = {"Accept": accept}
        took = await asyncio.gather(
            *(
                _scrapes(f"{pair.base(name)}/gpu/metrics", headers, i * SCRAPE_EVERY / 2)
                for i, name in enumerate(pair.ports)
            )
        )
    finally:
        pair.close()
    rows = []
    for name, ms in zip(pair.ports, took, strict=True):
        note = f"{len(ms)} scrapes every {SCRAPE_EVERY:g} s; max {max(ms):.1f} ms"
        rows += [
            Row("render", f"scrape p50 {label}: {name}", percentile(ms, 50), "ms", note),
            Row("render", f"scrape p99 {label}: {name}", percentile(ms, 99), "ms", note),
        ]
    return rows


async def run() -> list[Row]:
    rev = _baseline_rev()
    with _checkout(rev) as baseline:
        if baseline is None:
            return [Row("render", f"baseline {rev}", 0, "", "not in this clone: nothing run")]
        rows: list[Row] = []
        with tempfile.TemporaryDirectory() as tmp:
            async with chart_node(tmp) as (api, _):
                rows += await _cpu(baseline, api, CPU_SECONDS, "at chart defaults (10 s)")
                one_s = api | {"COLLECT_INTERVAL": "1s"}
                rows += await _cpu(baseline, one_s, CPU_1S_SECONDS, "at COLLECT_INTERVAL=1s")
                rows += await _latency(baseline, api, OPENMETRICS, "chart defaults, OpenMetrics")
            socket = str(Path(tmp) / "crowded.sock")
            kubelet = _start_kubelet(socket, PODS)
            try:
                crowded = {
                    "POD_RESOURCES_SOCKET": socket,
                    "METRICS_NAMING": "dcgm",
                    "COLLECT_INTERVAL": "1s",
                }
                label = f"{PODS:,} pods dcgm text, 1 s collection"
                rows += await _latency(baseline, crowded, "text/plain", label)
            finally:
                kubelet.terminate()
                kubelet.wait(10)
    baseline_of = f"baseline ({rev[:12]})"
    return [dataclasses.replace(r, name=r.name.replace("baseline", baseline_of)) for r in rows]
