"""Per-process shares: the cost of one attribution refresh at 8 GPUs x 128 processes across 64
pods (NVML process lists from the simulated driver, /proc cgroup reads from a tree on disk, the
mapping to holders and shares, the render), and /gpu/metrics scrape latency of the simulated
`timesliced` node with process attribution on and off (same run, interleaved)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
import time
import uuid as uuidlib
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp

from benchmarks.agentproc import free_port, load, start_agent, stop, wait_http
from benchmarks.common import Row, median, percentile
from gpuid_agent.facts import GpuIdentity, GpuSample, NodeInventory
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.simulate.profiles import SimProcess
from gpuid_agent.sources.kube.pods import PodMeta
from gpuid_agent.sources.nvml.calls import FieldCalls
from gpuid_agent.sources.nvml.process_reader import ProcessReader
from gpuid_agent.sources.procfs import HostProc
from gpuid_agent.state.attribution.holders import Allocation, Attribution, Holder
from gpuid_agent.state.attribution.process_mapping import share_processes
from gpuid_agent.state.attribution.shares import PROCESSES_OFF

NODE = "bench-node"
GPUS, PROCESSES, PODS = 8, 128, 64
ROUNDS = 200
GIB = 1024**3


def _time(fn: Callable[[], Any], rounds: int = ROUNDS) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _node(tmp: Path) -> tuple[SimulatedNvml, Attribution, dict[str, PodMeta], HostProc]:
    """64 pods, 8 per GPU (time-sliced), each running 2 processes: 128 in all."""
    nvml = SimulatedNvml("h100x8", NODE)
    nvml.init()
    pods: dict[str, PodMeta] = {}
    allocations = []
    for p in range(PODS):
        gpu = nvml.gpus[p % GPUS]
        uid = str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"pod-{p}"))
        cid = hashlib.sha256(uid.encode()).hexdigest()
        meta = PodMeta(f"team-{p % 4}", f"job-{p}", uid, containers=MappingProxyType({cid: "main"}))
        pods[uid] = meta
        holder = Holder(meta.namespace, meta.name, "main", pod_uid=uid)
        allocations.append(Allocation(holder, "nvidia.com/gpu", f"{gpu.uuid}::{p}", gpu.uuid))
        for k in range(PROCESSES // PODS):
            pid = 10_000 + p * 10 + k
            gpu.processes.append(SimProcess(pid, GIB // 4, 5))
            d = tmp / str(pid)
            d.mkdir()
            under = uid.replace("-", "_")
            (d / "cgroup").write_text(
                "0::/kubepods.slice/kubepods-burstable.slice/"
                f"kubepods-burstable-pod{under}.slice/cri-containerd-{cid}.scope\n"
            )
    by_device: dict[str, list[Holder]] = {}
    for a in allocations:
        by_device.setdefault(a.gpu_uuid, []).append(a.holder)
    attribution = Attribution(
        "current",
        allocations=tuple(allocations),
        by_device=MappingProxyType({k: tuple(v) for k, v in by_device.items()}),
    )
    return nvml, attribution, pods, HostProc(str(tmp))


def refresh_rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="bench-proc-", dir="/tmp") as tmp:
        nvml, attribution, pods, host = _node(Path(tmp))
        gpus = tuple(
            GpuIdentity(i, g.uuid, name=g.name, minor_number=i) for i, g in enumerate(nvml.gpus)
        )
        inventory = NodeInventory(NODE, "c", "m", "s", None, None, gpus, datetime.now(UTC))
        samples = {
            g.uuid: GpuSample(
                g.uuid, MappingProxyType({"memory_used_bytes": 40 * GIB, "gpu_util": 90})
            )
            for g in gpus
        }
        reader = ProcessReader(FieldCalls(logging.getLogger("bench")))
        readings = reader.read(nvml, gpus)
        pids = {p.pid for r in readings.values() for p in r.processes}
        assert len(pids) == PROCESSES
        owners = host.owners(pids)

        def mapping() -> Any:
            return share_processes(
                inventory, samples, attribution, readings, owners, by_uid=pods.get
            )

        view = mapping()
        assert sum(len(d.processes) for d in view.devices.values()) == PROCESSES
        assert all(u.holder is not None for d in view.devices.values() for u in d.processes)
        nvml_t = _time(lambda: reader.read(nvml, gpus))
        proc_t = _time(lambda: host.owners(pids))
        map_t = _time(mapping)

        def render(processes: Any) -> int:
            families = gpu_metrics.collect(
                inventory, samples, "prometheus", attribution=attribution, processes=processes
            )
            return len(gpu_metrics.expose(families, "text"))

        on_bytes, off_bytes = render(view), render(PROCESSES_OFF)
        render_on = _time(lambda: render(view), 50)
        render_off = _time(lambda: render(PROCESSES_OFF), 50)
    note = f"{GPUS} GPUs x {PROCESSES} processes, {PODS} pods, {ROUNDS} rounds"
    total = median(nvml_t) + median(proc_t) + median(map_t)
    return [
        Row("processes", "NVML process lists + samples, median", median(nvml_t) * 1000, "ms",
            "simulated driver (Python): the agent's side only"),
        Row("processes", "/proc cgroup reads, median", median(proc_t) * 1000, "ms",
            f"{PROCESSES} files on disk"),
        Row("processes", "/proc cgroup reads, p99", percentile(proc_t, 99) * 1000, "ms", ""),
        Row("processes", "map to holders + shares, median", median(map_t) * 1000, "ms", note),
        Row("processes", "map to holders + shares, p99", percentile(map_t, 99) * 1000, "ms", ""),
        Row("processes", "refresh total, median", total * 1000, "ms", "per collection"),
        Row("processes", "render with shares, median", median(render_on) * 1000, "ms",
            f"{on_bytes // 1024} KiB body"),
        Row("processes", "render without, median", median(render_off) * 1000, "ms",
            f"{off_bytes // 1024} KiB body"),
    ]  # fmt: skip


async def _until(url: str, needle: bytes, within: float = 30.0) -> bytes:
    started = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        while time.perf_counter() - started < within:
            async with http.get(url) as resp:
                body = await resp.read()
                if needle in body:
                    return body
            await asyncio.sleep(0.02)
    raise TimeoutError(needle.decode())


async def scrape_rows() -> list[Row]:
    ports = {"on": free_port(), "off": free_port()}
    env = {"NODE_NAME": NODE, "POD_RESOURCES_INTERVAL": "0.5s"}
    procs = {
        "on": start_agent(ports["on"], "--simulate", "timesliced", env=env),
        "off": start_agent(
            ports["off"], "--simulate", "timesliced", env=env | {"PROCESS_ATTRIBUTION": "false"}
        ),
    }
    url = {n: f"http://127.0.0.1:{p}/gpu/metrics" for n, p in ports.items()}
    try:
        for name in procs:
            await wait_http(url[name].replace("/gpu/metrics", "/readyz"))
        bodies = {
            "on": await _until(url["on"], b'allocated="true"'),
            "off": await _until(url["off"], b"gpuid_gpu_allocation_info{"),
        }
        latencies: dict[str, list[float]] = {"on": [], "off": []}
        for name in latencies:
            await load(url[name], requests=300)
        for _ in range(3):
            for name in latencies:
                latencies[name] += await load(url[name], requests=1000)
    finally:
        for proc in procs.values():
            stop(proc)
    note = f"--simulate timesliced, 32 clients, {len(latencies['on'])} requests each"
    return [
        Row("processes", f"/gpu/metrics shares {n} p{q}", percentile(latencies[n], q) * 1000,
            "ms", note if (n, q) == ("on", 50) else f"{len(bodies[n]) // 1024} KiB body")
        for n in ("on", "off")
        for q in (50, 99)
    ]  # fmt: skip


async def run() -> list[Row]:
    return [*refresh_rows(), *await scrape_rows()]
