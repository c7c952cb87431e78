"""Pod attribution: /gpu/metrics scrape latency with 8 GPUs x 16 pods vs 0 pods vs a static
handler (same run, interleaved), and time from a pod appearing in the kubelet to its labels.
Reading the kubelet's List answer is measured by bench_kubelet_decode."""

from __future__ import annotations

import asyncio
import random
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.agentproc import free_port, load, start_agent, start_static, stop, wait_http
from benchmarks.common import Row, median, percentile
from gpuid_agent.simulate.kubelet import FakeKubelet
from gpuid_agent.simulate.pods import KubeletPod, pod
from gpuid_agent.simulate.profiles import PROFILES

NODE = "bench-node"
PODS_PER_GPU = 16
INTERVAL = 2.0  # POD_RESOURCES_INTERVAL's default
APPEARANCES = 6


def crowded(uuids: list[str]) -> list[KubeletPod]:
    """Every GPU time-shared by 16 pods (`GPU-…::N` replicas)."""
    return [
        pod(f"team-{r % 4}", f"job-{i}-{r}", "main", "nvidia.com/gpu", f"{uuid}::{r}")
        for i, uuid in enumerate(uuids)
        for r in range(PODS_PER_GPU)
    ]


async def _body(url: str) -> bytes:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return await resp.read()


async def _until_in_body(url: str, needle: bytes, within: float = 30.0) -> float:
    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - started < within:
            async with http.get(url) as resp:
                if needle in await resp.read():
                    return time.perf_counter() - started
            await asyncio.sleep(0.01)
    raise TimeoutError(needle.decode())


def _ms(values: list[float], pct: float) -> float:
    return percentile(values, pct) * 1000


async def run() -> list[Row]:
    uuids = [g.uuid for g in PROFILES["h100x8"](NODE)]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-attr-", dir="/tmp") as tmp:
        empty = FakeKubelet(str(Path(tmp) / "empty.sock"))
        full = FakeKubelet(str(Path(tmp) / "full.sock"), crowded(uuids))
        await empty.start()
        await full.start()
        ports = {name: free_port() for name in ("empty", "full", "dcgm")}
        common = {"NODE_NAME": NODE, "POD_RESOURCES_INTERVAL": f"{INTERVAL}s"}

        def agent(name: str, kubelet: FakeKubelet, **env: str) -> subprocess.Popen[bytes]:
            return start_agent(
                ports[name],
                "--simulate",
                "h100x8",
                env=common | {"POD_RESOURCES_SOCKET": kubelet.socket_path} | env,
            )

        url = {n: f"http://127.0.0.1:{p}/gpu/metrics" for n, p in ports.items()}
        procs = {"empty": agent("empty", empty), "full": agent("full", full)}
        try:
            for name in procs:
                await wait_http(url[name].replace("/gpu/metrics", "/readyz"))
            last = f'pod="job-7-{PODS_PER_GPU - 1}"'.encode()
            await _until_in_body(url["full"], last)
            bodies = {n: await _body(url[n]) for n in procs}
            path = Path(tmp) / "body"
            path.write_bytes(bodies["full"])
            sport = free_port()
            procs["static"] = start_static(sport, path)
            url["static"] = f"http://127.0.0.1:{sport}/gpu/metrics"
            await wait_http(url["static"])

            latencies: dict[str, list[float]] = {n: [] for n in ("static", "full", "empty")}
            for name in latencies:
                await load(url[name], requests=300)  # warm-up
            for _ in range(3):  # interleaved rounds: drift in machine load hits all three
                for name in latencies:
                    latencies[name] += await load(url[name], requests=1000)

            # a pod appears in the kubelet; how long until /gpu/metrics names it
            appear: list[float] = []
            for i in range(APPEARANCES):
                await asyncio.sleep(random.uniform(0, INTERVAL))  # vary the poll phase
                name = f"appear-{i}"
                empty.pods = [*empty.pods, pod("bench", name, "c", "nvidia.com/gpu", uuids[i % 8])]
                appear.append(await _until_in_body(url["empty"], f'pod="{name}"'.encode()))
            for name in ("static", "empty"):
                stop(procs.pop(name))

            # dcgm naming repeats every series per holder: measured alone, for reference
            procs["dcgm"] = agent("dcgm", full, METRICS_NAMING="dcgm")
            await wait_http(url["dcgm"].replace("/gpu/metrics", "/readyz"))
            await _until_in_body(url["dcgm"], last)
            bodies["dcgm"] = await _body(url["dcgm"])
            await load(url["dcgm"], requests=300)
            dcgm = await load(url["dcgm"], requests=3000)
        finally:
            for proc in procs.values():
                stop(proc)
            await empty.stop()
            await full.stop()

    full_ms, empty_ms, static_ms = latencies["full"], latencies["empty"], latencies["static"]
    note = f"32 clients, {len(full_ms)} requests each, same run"
    rows += [
        Row("attribution", "8x16 pods /gpu/metrics p50", _ms(full_ms, 50), "ms", note),
        Row("attribution", "8x16 pods /gpu/metrics p99", _ms(full_ms, 99), "ms", note),
        Row("attribution", "0 pods /gpu/metrics p50", _ms(empty_ms, 50), "ms", note),
        Row("attribution", "0 pods /gpu/metrics p99", _ms(empty_ms, 99), "ms", note),
        Row("attribution", "static bytes p50", _ms(static_ms, 50), "ms", "the 8x16 body"),
        Row("attribution", "static bytes p99", _ms(static_ms, 99), "ms", "the 8x16 body"),
        Row(
            "attribution",
            "8x16 p50 / 0 pods p50",
            percentile(full_ms, 50) / percentile(empty_ms, 50),
            "x",
            "goal: equal within noise",
        ),
        Row(
            "attribution",
            "8x16 p99 / static p99",
            percentile(full_ms, 99) / percentile(static_ms, 99),
            "x",
            "goal ≤ 1.5",
        ),
        Row(
            "attribution", "body 8x16 pods", len(bodies["full"]) / 1024, "KiB", "prometheus naming"
        ),
        Row("attribution", "body 0 pods", len(bodies["empty"]) / 1024, "KiB", ""),
        Row(
            "attribution",
            "dcgm naming 8x16 p50",
            _ms(dcgm, 50),
            "ms",
            f"per-holder series, {len(bodies['dcgm']) // 1024} KiB body",
        ),
        Row("attribution", "dcgm naming 8x16 p99", _ms(dcgm, 99), "ms", ""),
        Row(
            "attribution",
            "pod appears → labels, median",
            median(appear) * 1000,
            "ms",
            f"{APPEARANCES} pods, POD_RESOURCES_INTERVAL={INTERVAL:g}s",
        ),
        Row(
            "attribution",
            "pod appears → labels, max",
            max(appear) * 1000,
            "ms",
            f"goal ≤ {(INTERVAL + 1) * 1000:g} ms",
        ),
    ]
    return rows
