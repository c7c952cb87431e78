"""Footprint on a simulated 8-GPU node at the chart's defaults, each figure beside its floor
measured in the same run and the goal.

- API client: what each way of using kubernetes_asyncio adds to a process that already holds
  the agent's other libraries (the whole package; its config/auth with the generated API
  classes; its config/auth with the agent's own JSON requests, the one used).
- RSS at ready and after a soak (BENCH_SOAK_SECONDS, default 60; the goal is for an hour) at
  the chart's defaults (stdout exporter, labels on, the API on: a fake API server) and with
  KUBE_API=off. Floor: a process importing the same agent modules and doing nothing. The
  kubelet serving the simulated node's pods runs in a process of its own, as on a real node
  (`--simulate` alone serves them from inside the agent).
- CPU over the soak (defaults) and over BENCH_CPU_SECONDS (default 60) at COLLECT_INTERVAL=1s,
  scraped like Prometheus every 30 s. Floor: an idle asyncio loop, over the same window.
- /healthz p99 at 10 s and 1 s collection with 1,024 pods from a real gRPC kubelet in a
  process of its own (benchmarks/kubelet_server.py), dcgm naming, /gpu/metrics scraped every
  15 s, polled for BENCH_HEALTHZ_SECONDS (default 30). Floor: a bare aiohttp server answering
  /healthz, polled the same way.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

from benchmarks.agentproc import free_port, rss_mib, start_agent, stop, wait_http
from benchmarks.common import Row, percentile
from tests.fakekube import FakeKube, write_kubeconfig

ROOT = str(Path(__file__).resolve().parent.parent)
SOAK = float(os.environ.get("BENCH_SOAK_SECONDS", "60"))
CPU_SECONDS = float(os.environ.get("BENCH_CPU_SECONDS", "60"))
POLL_SECONDS = float(os.environ.get("BENCH_HEALTHZ_SECONDS", "30"))
WARMUP = 10.0
NODE = "node-a"
PODS = 1024
DEFAULTS = {"SIMULATE": "h100x8", "NODE_NAME": NODE, "EXPORTER_TYPE": "stdout", "PYTHONPATH": ROOT}

# The libraries the agent holds anyway; each option's cost is measured on top of them.
_BASE = "import aiohttp, orjson, prometheus_client, pydantic, yaml"
_OPTIONS = {
    "whole package (import kubernetes_asyncio)": "import kubernetes_asyncio",
    "config/auth + generated API classes": (
        "from gpuid_agent.sources.kube import library; library.load()\n"
        "from kubernetes_asyncio.client.api import core_v1_api, apps_v1_api, batch_v1_api"
    ),
    "config/auth + own JSON requests (used)": (
        "from gpuid_agent.sources.kube import library; library.load()"
    ),
}
# The kubelet client's cost the same way: the agent's own, and grpcio with the generated stubs.
_KUBELET_OPTIONS = {
    "kubelet client: own HTTP/2 + protobuf (upb) messages (used)": (
        "from gpuid_agent.sources.kubelet import client"
    ),
    "kubelet client: grpcio + protobuf stubs": (
        "import grpc.aio\nfrom gpuid_agent.sources.kubelet.v1 import api_pb2, api_pb2_grpc"
    ),
}
_MEASURE = """
import gc, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
{base}
gc.collect(); before, modules = rss(), len(sys.modules)
{option}
gc.collect()
print(rss() - before, len(sys.modules) - modules, before)
"""
_IDLE = "import asyncio; asyncio.run(asyncio.sleep(86400))"
# A kubelet client in a process of its own: CPU of a connection polled every `every` seconds
# (0: dialled once, never polled again; -1: no client at all, the floor), over `seconds`. The
# agent's own client, or a grpcio channel making the same call (what the agent used before).
_POLL = """
import asyncio, os, sys, time
async def main(kind, socket, every, seconds):
    if kind == "grpcio":
        import grpc.aio
        channel = grpc.aio.insecure_channel("unix://" + socket)
        call = channel.unary_unary("/v1.PodResourcesLister/List")
        poll = lambda: call(b"", timeout=5)
    else:
        from gpuid_agent.sources.kubelet.client import PodResourcesClient
        poll = PodResourcesClient(socket, timeout=5).list_bytes
    if every >= 0:
        await poll()
    every = max(every, 0)
    await asyncio.sleep(2)
    used, started = sum(os.times()[:2]), time.monotonic()
    while time.monotonic() - started < seconds:
        if every:
            await poll()
        await asyncio.sleep(every or 1.0)
    print((sum(os.times()[:2]) - used) / (time.monotonic() - started) * 100)
asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])))
"""
_IMPORT_FLOOR = """
import sys, time
import gpuid_agent.cli, gpuid_agent.agent, gpuid_agent.delivery.exporters.stdout
import gpuid_agent.simulate.node, pynvml
if sys.argv[1] == "api":
    from gpuid_agent.sources.kube import library; library.load()
print("ready", flush=True)
time.sleep(86400)
"""
_HEALTHZ_FLOOR = """
import sys
from aiohttp import web
async def ok(request):
    return web.json_response({"ok": True, "problems": []})
app = web.Application()
app.router.add_get("/healthz", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def _python(code: str, *args: str, out: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=out,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process, all its threads (ended ones too), from the
    kernel's CPU-time clock for it: nanoseconds, where /proc/<pid>/stat counts 10 ms ticks (a
    tick is 0.017 % of a core over a 60 s window, too coarse for figures near 0.1 %)."""
    return time.clock_gettime(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of process `pid`


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU time so far of each group of a process's threads, by name (digits dropped: gRPC,
    the asyncio executor and the NVML thread number theirs; the agent names its NVML and XID
    threads for the OS)."""
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip().rstrip("0123456789_") or "?"
            used = int((task / "schedstat").read_text().split()[0]) / 1e9  # ns on a CPU
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
        found[name] = found.get(name, 0.0) + used
    return found


def _by_thread(before: dict[str, float], after: dict[str, float], elapsed: float) -> str:
    used = {k: (v - before.get(k, 0.0)) / elapsed * 100 for k, v in after.items()}
    top = sorted(((v, k) for k, v in used.items() if v >= 0.005), reverse=True)[:5]
    return ", ".join(f"{k} {v:.3f}" for v, k in top)


def client_options() -> list[Row]:
    rows = []
    for name, option in (_OPTIONS | _KUBELET_OPTIONS).items():
        proc = _python(_MEASURE.format(base=_BASE, option=option), out=subprocess.PIPE)
        out, _ = proc.communicate(timeout=120)
        added, modules, floor = out.split()
        note = f"+{int(modules)} modules over {float(floor):.1f} MiB with the other libraries"
        label = name if name.startswith("kubelet") else f"API client: {name}"
        rows.append(Row("footprint", label, float(added), "MiB added", note))
    return rows


async def _scrape(base: str, every: float, until: float) -> None:
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            for path in ("/gpu/metrics", "/metrics"):
                async with http.get(base + path) as resp:
                    await resp.read()
            await asyncio.sleep(min(every, max(0.0, until - time.monotonic())))


class Floors:
    """An import-floor process and an idle asyncio loop, running beside the agent."""

    def __init__(self, with_api: bool) -> None:
        self.imports = _python(_IMPORT_FLOOR, "api" if with_api else "off", out=subprocess.PIPE)
        self.idle = _python(_IDLE)
        assert self.imports.stdout is not None
        self.imports.stdout.readline()  # "ready": everything imported

    def close(self) -> None:
        for proc in (self.imports, self.idle):
            proc.terminate()
            proc.wait(10)


async def _soak(env: dict[str, str], label: str, goal_ready: str, goal_soak: str) -> list[Row]:
    floors = Floors(with_api=env.get("KUBE_API") != "off")
    port = free_port()
    agent = start_agent(port, env=DEFAULTS | env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_http(f"{base}/readyz", within=120)
        at_ready, floor = rss_mib(agent.pid), rss_mib(floors.imports.pid)
        await asyncio.sleep(WARMUP)
        cpu, idle, started = cpu_seconds(agent.pid), cpu_seconds(floors.idle.pid), time.monotonic()
        threads = thread_seconds(agent.pid)
        await _scrape(base, 30.0, started + SOAK)
        elapsed = time.monotonic() - started
        threads_used = _by_thread(threads, thread_seconds(agent.pid), elapsed)
        cpu = (cpu_seconds(agent.pid) - cpu) / elapsed * 100
        idle = (cpu_seconds(floors.idle.pid) - idle) / elapsed * 100
        soaked = rss_mib(agent.pid)
    finally:
        stop(agent)
        floors.close()
    rows = [
        Row(
            "footprint",
            f"RSS at ready ({label})",
            at_ready,
            "MiB",
            _vs(at_ready, floor, goal_ready),
        ),
        Row(
            "footprint",
            f"RSS after {elapsed:.0f} s soak ({label})",
            soaked,
            "MiB",
            _vs(soaked, floor, goal_soak),
        ),
    ]
    if label == "chart defaults":
        rows.append(_cpu_row("CPU at chart defaults (10 s)", cpu, idle, elapsed, threads_used))
    return rows


def _vs(value: float, floor: float, goal: str) -> str:
    return f"{value / floor:.2f}x import floor {floor:.1f} MiB; goal {goal}"


def _cpu_row(name: str, cpu: float, idle: float, elapsed: float, threads: str) -> Row:
    note = (
        f"idle loop {idle:.3f} % over {elapsed:.0f} s; goal <= 0.12 % at 10 s; by thread: {threads}"
    )
    return Row("footprint", name, cpu, "% of a core", note)


async def _cpu_at_1s(env: dict[str, str]) -> Row:
    idle_proc = _python(_IDLE)
    port = free_port()
    agent = start_agent(port, env=DEFAULTS | env | {"COLLECT_INTERVAL": "1s"})
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_http(f"{base}/readyz", within=120)
        await asyncio.sleep(WARMUP)
        cpu, idle, started = cpu_seconds(agent.pid), cpu_seconds(idle_proc.pid), time.monotonic()
        threads = thread_seconds(agent.pid)
        await _scrape(base, 30.0, started + CPU_SECONDS)
        elapsed = time.monotonic() - started
        threads_used = _by_thread(threads, thread_seconds(agent.pid), elapsed)
        cpu = (cpu_seconds(agent.pid) - cpu) / elapsed * 100
        idle = (cpu_seconds(idle_proc.pid) - idle) / elapsed * 100
    finally:
        stop(agent)
        idle_proc.terminate()
        idle_proc.wait(10)
    return _cpu_row("CPU at COLLECT_INTERVAL=1s", cpu, idle, elapsed, threads_used)


async def _poll(url: str, seconds: float, scrape: str | None = None) -> list[float]:
    """Milliseconds of each /healthz answer, polled every 20 ms (while `scrape` is fetched
    every 15 s, as Prometheus would)."""
    until = time.monotonic() + seconds
    scraping = asyncio.create_task(_scrape(scrape, 15.0, until)) if scrape else None
    latencies = []
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < until:
            started = time.perf_counter()
            async with http.get(url) as resp:
                await resp.read()
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.02)
    if scraping is not None:
        await scraping
    return latencies


async def _healthz_with_kubelet(interval: str, socket: str) -> list[float]:
    port = free_port()
    env = DEFAULTS | {
        "POD_RESOURCES_SOCKET": socket,
        "METRICS_NAMING": "dcgm",
        "COLLECT_INTERVAL": interval,
    }
    agent = start_agent(port, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_http(f"{base}/readyz", within=120)
        await asyncio.sleep(max(WARMUP, 2 * float(interval.rstrip("s"))))
        return await _poll(f"{base}/healthz", POLL_SECONDS, scrape=base)
    finally:
        stop(agent)


def _start_kubelet(socket: str, pods: int) -> subprocess.Popen[str]:
    kubelet = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.kubelet_server", socket, NODE, str(pods)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert kubelet.stdout is not None
    kubelet.stdout.readline()  # "serving"
    return kubelet


async def healthz_rows() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        socket = str(Path(tmp) / "kubelet.sock")
        kubelet = _start_kubelet(socket, PODS)
        try:
            port = free_port()
            floor_proc = _python(_HEALTHZ_FLOOR, str(port))
            await wait_http(f"http://127.0.0.1:{port}/healthz")
            floor = percentile(await _poll(f"http://127.0.0.1:{port}/healthz", POLL_SECONDS), 99)
            floor_proc.terminate()
            floor_proc.wait(10)
            rows = []
            for interval in ("10s", "1s"):
                ms = await _healthz_with_kubelet(interval, socket)
                p99 = percentile(ms, 99)
                note = (
                    f"{p99 / floor:.2f}x bare aiohttp p99 {floor:.1f} ms; max {max(ms):.1f} ms; "
                    f"{PODS} pods via gRPC kubelet, dcgm; goal <= 20 ms at 1 s"
                )
                rows.append(
                    Row("footprint", f"/healthz p99 at {interval} collection", p99, "ms", note)
                )
        finally:
            kubelet.terminate()
            kubelet.wait(10)
    return rows


def kubelet_client_rows(socket: str) -> list[Row]:
    """What polling the kubelet costs idle: the agent's client at the default
    POD_RESOURCES_INTERVAL, dialled but not polled, and grpcio making the same calls."""
    cases = {
        "floor": ("own", "-1"),
        "kubelet client dialled, not polled": ("own", "0"),
        "kubelet client polled every 2 s": ("own", "2"),
        "grpcio channel polled every 2 s (the client before)": ("grpcio", "2"),
    }
    seconds = str(CPU_SECONDS)
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _POLL, kind, socket, every, seconds],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, (kind, every) in cases.items()
    }
    used = {
        name: float(proc.communicate(timeout=CPU_SECONDS + 60)[0]) for name, proc in procs.items()
    }
    floor = used.pop("floor")
    note = f"the client alone in a process; idle asyncio loop {floor:.3f} %"
    return [Row("footprint", name, value, "% of a core", note) for name, value in used.items()]


@asynccontextmanager
async def chart_node(tmp: str) -> AsyncIterator[tuple[dict[str, str], str]]:
    """The simulated node's own pods, served from a process of its own as on a real node, and an
    API server that knows the node: the settings of an agent at the chart's defaults there,
    and the kubelet's socket."""
    socket = str(Path(tmp) / "kubelet.sock")
    kubelet = _start_kubelet(socket, 0)
    try:
        async with FakeKube() as kube:
            kube.add_node(NODE, labels={"kubernetes.io/hostname": NODE})
            api = {"KUBECONFIG": str(write_kubeconfig(Path(tmp) / "kc", kube.url))}
            api |= {"KUBE_API": "auto", "LABELS": "on", "POD_RESOURCES_SOCKET": socket}
            os.environ.pop("KUBERNETES_SERVICE_HOST", None)
            yield api, socket
    finally:
        kubelet.terminate()
        kubelet.wait(10)


async def run() -> list[Row]:
    rows = client_options()
    with tempfile.TemporaryDirectory() as tmp:
        async with chart_node(tmp) as (api, socket):
            rows += await _soak(api, "chart defaults", "<= 100 MiB", "<= 110 MiB after 1 h")
            off = {"KUBE_API": "off", "POD_RESOURCES_SOCKET": socket}
            rows += await _soak(off, "KUBE_API=off", "<= 72 MiB", "<= 72 MiB")
            rows.append(await _cpu_at_1s(api))
            rows += kubelet_client_rows(socket)
    rows += await healthz_rows()
    return rows
