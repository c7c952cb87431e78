"""GPU health: evaluation and reading cost per collection, /gpu/metrics growth, XID latency."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pynvml

from benchmarks.common import Row, median, percentile
from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity
from gpuid_agent.runtime import log
from gpuid_agent.runtime.config_load import load_settings
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.nvml.fields import AER_FIELDS, NVLINK_SPEED_FIELD, RECOVERY_ACTION_FIELD
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.signals import EccCounts, FabricInfo, GpuHealthSignals, RemappedRows
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.state.attribution.holders import UNAVAILABLE
from gpuid_agent.state.health.tracker import HealthTracker
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.snapshot import NodeSnapshot

GPUS = 8


def _signals(i: int, tick: int) -> GpuHealthSignals:
    return GpuHealthSignals(
        index=i,
        uuid=f"GPU-{i}",
        ecc=EccCounts(tick // 100, 0, tick // 100, 0),
        retired_pages_pending=False,
        remapped_rows=RemappedRows(0, 0, False, False),
        clocks_event_reasons=0x1 if tick % 3 else 0x4,
        fabric=FabricInfo(3, 0, 0x5AAA, 1, None, 1),
        persistence_mode=1,
    )


def _tracker_cost() -> float:
    gpus = [GpuIdentity(index=i, uuid=f"GPU-{i}") for i in range(GPUS)]
    clock = [0.0]
    tracker = HealthTracker(window=300.0, clock=lambda: clock[0])
    samples = []
    for tick in range(2000):
        clock[0] = tick * 10.0
        signals = {i: _signals(i, tick) for i in range(GPUS)}
        started = time.perf_counter()
        tracker.observe(gpus, signals, {}, expected_gpus=GPUS)
        tracker.snapshot()
        samples.append(time.perf_counter() - started)
    return median(samples) * 1e6


async def _read_cost_fake_library(
    links: bool = False, fields: bool | None = None
) -> tuple[float, str, float]:
    """HealthReader.read for 8 GPUs through the real pynvml and the C fake library; with
    `links`, each GPU also has a PCIe link and 18 NVLinks with error counters. `fields`: True,
    the driver reports the recovery action (field 230), the PCIe AER counters and link speeds,
    all read in one nvmlDeviceGetFieldValues call per GPU; False, a library without that call;
    None, the call answers NOT_SUPPORTED entries. Also that one call alone, 8 GPUs (µs)."""
    try:
        from tests.fakenvml import build_fake_nvml, h100x8, load_fake_into_pynvml, with_links
    except ImportError:
        return float("nan"), "tests package not importable", float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        omit = ["nvmlDeviceGetFieldValues"] if fields is False else []
        lib = build_fake_nvml(Path(tmp), omit=omit)
        config = Path(tmp) / "fake.conf"
        node = h100x8()
        if links:
            node.gpus = [with_links(g) for g in node.gpus]
        if fields:
            for gpu in node.gpus:  # recovery action none, AER counters, NVLink speed (MB/s)
                gpu.fields = {"230": 0, "173": 3, "179": 0, "180": 0, "164": 26562}
        node.write(config)
        os.environ["FAKE_NVML_CONFIG"] = str(config)
        load_fake_into_pynvml(lib)
        api = PynvmlApi(str(lib))
        source = NvmlSource(api)
        await source.init()
        try:
            reading = await source.read()
            targets = {g.index: g.uuid for g in reading.gpus}
            reader = HealthReader(api)
            samples = []
            for _ in range(300):
                started = time.perf_counter()
                await source.run(lambda: reader.read(targets))
                samples.append(time.perf_counter() - started)
            handles = [api.handle_by_index(i) for i in sorted(targets)]
            links_of = [len(g.nvlinks or ()) for g in reader.read(targets).values()]
            asked = [
                [(RECOVERY_ACTION_FIELD, 0), *((f, 0) for f in AER_FIELDS)]
                + [(NVLINK_SPEED_FIELD, link) for link in range(n)]
                for n in links_of
            ]
            call_samples = []
            for _ in range(300):
                started = time.perf_counter()
                for handle, ids in zip(handles, asked, strict=True):
                    with contextlib.suppress(pynvml.NVMLError):
                        api.field_values(handle, ids)
                call_samples.append(time.perf_counter() - started)
        finally:
            await source.close()
            os.environ.pop("FAKE_NVML_CONFIG", None)
    note = "C fake libnvidia-ml; a real driver adds its own call cost"
    return median(samples) * 1e3, note, median(call_samples) * 1e6


def _render_cost() -> tuple[float, float, int, int]:
    api = SimulatedNvml("h100x8", "bench")
    api.init()
    from gpuid_agent.sources.nvml.reader import NvmlReader
    from gpuid_agent.state.inventory import build_inventory

    reading = NvmlReader(api).read({})
    inventory = build_inventory(
        reading.gpus,
        node="bench",
        cluster="c",
        machine="m",
        machine_source="simulated",
        driver_version=reading.driver_version,
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )
    tracker = HealthTracker()
    signals = HealthReader(api).read({g.index: g.uuid for g in reading.gpus})
    tracker.observe(reading.gpus, signals, {}, expected_gpus=GPUS)
    health = tracker.snapshot()

    renderer = MetricsRenderer("prometheus", (), None)

    def timed(with_health: bool) -> tuple[float, int]:
        snapshot = NodeSnapshot(
            seq=1,
            cause="collection",
            inventory=inventory,
            samples=reading.samples,
            health=health if with_health else NodeHealth(),
            attribution=UNAVAILABLE,
        )
        samples, size = [], 0
        for _ in range(200):
            started = time.perf_counter()
            # what the renderer does for each snapshot, in its thread: families, then text
            out = gpu_metrics.expose(renderer.families(snapshot), "text")
            samples.append(time.perf_counter() - started)
            size = len(out)
        return median(samples) * 1e3, size

    plain, plain_size = timed(False)
    full, full_size = timed(True)
    return plain, full, plain_size, full_size


async def _xid_latency() -> list[float]:
    api = SimulatedNvml("h100x8", "bench")
    settings = load_settings(
        {
            "simulate": "h100x8",
            "server_address": "127.0.0.1",
            "server_port": 0,
            "node_name": "bench",
            "collect_interval": 1.0,
            "xid_hold": 0.001,
            "dmi_product_uuid_path": "",
            "machine_id_path": "",
        }
    )
    agent = Agent(settings, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])
    await agent.start()
    latencies = []
    try:
        xid = agent.collector.health.xid
        while not xid.alive or xid.unavailable:  # noqa: ASYNC110 - polled state
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the watcher registers the GPUs
        for n in range(40):
            gpu = n % GPUS
            before = xid_13_count(agent, gpu)
            started = time.perf_counter()
            api.inject_xid(gpu, 13)
            # polling in 0.5 ms steps is the measurement (it adds up to 0.5 ms)
            while xid_13_count(agent, gpu) == before:  # noqa: ASYNC110
                await asyncio.sleep(0.0005)
            latencies.append(time.perf_counter() - started)
    finally:
        await agent.stop()
    return latencies


def xid_13_count(agent: Agent, gpu: int) -> int:
    """XID 13s on a GPU as the agent last published them (the snapshot every consumer reads)."""
    last = agent.bus.latest
    return 0 if last is None else last.health.gpus[gpu].xid_counts.get(13, 0)


async def run() -> list[Row]:
    log.configure("error")  # the XID latency run logs a transition per injection
    rows = [
        Row("health", "evaluate 8 GPUs (observe + snapshot)", _tracker_cost(), "µs", "median"),
    ]
    read_ms, note, _ = await _read_cost_fake_library(fields=False)
    what = "read health signals, 8 GPUs, no field values call"
    rows.append(Row("health", what, read_ms, "ms", note))
    read_ms, note, field_us = await _read_cost_fake_library(fields=True)
    rows.append(Row("health", "read health signals, 8 GPUs", read_ms, "ms", note))
    rows.append(Row("health", "field values call alone, 8 GPUs", field_us, "µs", "median"))
    read_ms, note, _ = await _read_cost_fake_library(links=True, fields=False)
    rows.append(
        Row("health", "read health signals, 8 GPUs, PCIe + 18 NVLinks each", read_ms, "ms", note)
    )
    read_ms, note, field_us = await _read_cost_fake_library(links=True, fields=True)
    what = "read health signals, 8 GPUs, PCIe + 18 NVLinks each, with field values"
    rows.append(Row("health", what, read_ms, "ms", note))
    what = "field values call alone (230, AER, 18 link speeds), 8 GPUs"
    rows.append(Row("health", what, field_us, "µs", "median"))
    plain, full, plain_size, full_size = _render_cost()
    rows += [
        Row("health", "render /gpu/metrics, 8 GPUs, no health", plain, "ms", f"{plain_size} B"),
        Row("health", "render /gpu/metrics, 8 GPUs, with health", full, "ms", f"{full_size} B"),
    ]
    latencies = await _xid_latency()
    rows += [
        Row("health", "XID injected → counted (p50)", median(latencies) * 1e3, "ms", "simulated"),
        Row(
            "health",
            "XID injected → counted (p95)",
            percentile(latencies, 95) * 1e3,
            "ms",
            "simulated",
        ),
    ]
    return rows
