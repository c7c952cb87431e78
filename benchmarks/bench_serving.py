"""/gpu/metrics at 1,024 pods with dcgm naming: render time, and /healthz latency during renders.

dcgm naming repeats every telemetry series per holder, so 8 GPUs x 128 pods is the heaviest
body the agent makes. The /healthz row runs the real app on a real aiohttp server, publishes a
new snapshot and scrapes it as soon as the last one is rendered (renders back to back) and polls
/healthz ~100 times a second; the "on the loop" row is the old approach (render called on the
loop as each snapshot arrives) for comparison.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import Collector

from benchmarks.agentproc import free_port
from benchmarks.common import Row, percentile
from gpuid_agent.facts import GpuIdentity, GpuSample
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.app import build_app
from gpuid_agent.serving.exposition import Family
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.bus import SnapshotBus, Subscription
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot

GPUS = 8
PODS = 1024
NAMING: gpu_metrics.Naming = "dcgm"
POLL_HZ = 100
POLL_SECONDS = 4.0
PUBLISH_EVERY = 0.05


def snapshot(seq: int) -> NodeSnapshot:
    gpus = [
        GpuIdentity(
            index=i,
            uuid=f"GPU-{i:08d}-0000-4000-8000-000000000000",
            serial=f"16520000{i:04d}",
            name="NVIDIA H100 80GB HBM3",
            pci_bus_id=f"00000000:{i + 0x10:02X}:00.0",
        )
        for i in range(GPUS)
    ]
    inventory = build_inventory(
        gpus,
        node="bench-node",
        cluster="bench",
        machine="m",
        machine_source="bench",
        driver_version="570.86.15",
        cuda_driver_version="12.8",
        read_time=datetime.now(UTC),
    )
    per_gpu = PODS // GPUS
    by_device = {
        gpu.uuid: tuple(
            Holder(f"team-{r % 4}", f"job-{gpu.index}-{r}", "main", workload_kind="Job")
            for r in range(per_gpu)
        )
        for gpu in gpus
    }
    samples = {
        gpu.uuid: GpuSample(gpu.uuid, {f.key: float(seq % 97 + n) for n, f in enumerate(FIELDS)})
        for gpu in gpus
    }
    return NodeSnapshot(
        seq=seq,
        cause="collection",
        inventory=inventory,
        samples=samples,
        health=NodeHealth(),
        attribution=Attribution("current", by_device=by_device),
    )


FIELDS = gpu_metrics.FIELDS


OPTIONS = gpu_metrics.RenderOptions(workload_labels=True)


@dataclasses.dataclass(frozen=True, slots=True)
class RenderedBoth:
    """Both formats of one snapshot, as the old approach rendered them."""

    text: bytes
    openmetrics: bytes


def _families(snap: NodeSnapshot, naming: gpu_metrics.Naming) -> list[Family]:
    return gpu_metrics.collect(
        snap.inventory,
        snap.samples,
        naming,
        snap.health,
        attribution=snap.attribution,
        options=OPTIONS,
    )


def _library_registry(families: list[Family]) -> CollectorRegistry:
    """The same families as prometheus_client objects, built sample by sample (the old way;
    dcgm's bare counters as gauges, which the library can write)."""
    built: list[Metric] = []
    for family in families:
        if family.type == "counter" and not family.bare:
            made: Metric = CounterMetricFamily(family.name, family.help, labels=family.labelnames)
        else:
            made = GaugeMetricFamily(family.name, family.help, labels=family.labelnames)
        for values, value in family.rows:
            made.add_metric(values, value)  # type: ignore[attr-defined]
        built.append(made)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collected(built))
    return registry


class _Collected(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _render_both(snap: NodeSnapshot) -> RenderedBoth:
    """What each snapshot cost two versions ago: families, then text and OpenMetrics through
    prometheus_client, on every snapshot."""
    registry = _library_registry(_families(snap, NAMING))
    return RenderedBoth(generate_latest(registry), om_generate_latest(registry))


def _render_on_loop(snap: NodeSnapshot) -> RenderedBoth:
    return _render_both(snap)


# (naming, format, goal in ms, the figure before this writer) per render row
RENDERS: tuple[tuple[gpu_metrics.Naming, gpu_metrics.Format, float | None, str], ...] = (
    ("dcgm", "text", 150.0, "220-276 ms before"),
    ("prometheus", "text", None, "19.5 ms before"),
    ("prometheus", "openmetrics", None, "60-88 ms before (text + OpenMetrics)"),
)


def _best(fn: Callable[[], Any], times: int) -> float:
    """Fastest of `times` runs, in ms: what the code costs when the machine lets it run."""
    took = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        took.append(time.perf_counter() - started)
    return min(took) * 1000


def render_rows() -> list[Row]:
    """Per naming and format, what the renderer does per snapshot (families, then bytes),
    against a floor measured in the same run: joining as many pre-formatted lines."""
    snap = snapshot(1)
    rows: list[Row] = []
    for naming, fmt, goal, before in RENDERS:
        body = gpu_metrics.expose(_families(snap, naming), fmt)
        lines = body.splitlines(keepends=True)
        floor = _best(lambda lines=lines: b"".join(lines), 5)
        took = _best(lambda n=naming, f=fmt: gpu_metrics.expose(_families(snap, n), f), 5)
        name = f"render {PODS:,} pods {naming} {fmt}"
        goal_note = f"goal ≤ {goal:g} ms; " if goal else ""
        rows += [
            Row("serving", name, took, "ms", f"best of 5; {goal_note}{before}"),
            Row("serving", f"{name}: bytes", len(body), "B", f"{len(lines):,} lines"),
            Row("serving", f"{name} / floor", took / floor, "x", f"floor {floor:.2f} ms"),
        ]
    rows.append(
        Row(
            "serving",
            f"render {PODS:,} pods dcgm text, prometheus_client",
            _best(lambda: generate_latest(_library_registry(_families(snap, NAMING))), 2),
            "ms",
            "best of 2; the same families as library objects, its generate_latest",
        )
    )
    return rows


class _Healthy:
    def liveness(self) -> tuple[bool, list[str]]:
        return True, []

    def readiness(self) -> tuple[bool, list[str]]:
        return True, []

    def status(self) -> dict[str, Any]:
        return {}


class _OnLoop:
    """The old approach: each snapshot rendered on the event loop."""

    def __init__(self) -> None:
        self.rendered = RenderedBoth(text=b"", openmetrics=b"# EOF\n")
        self.seq = 0
        self.renders = 0
        self.openmetrics_offered = True

    async def body(self, fmt: gpu_metrics.Format, scraper: str | None) -> bytes:
        return self.rendered.text if fmt == "text" else self.rendered.openmetrics

    async def run(self, subscription: Subscription) -> None:
        async for snap in subscription:
            self.rendered = _render_on_loop(snap)
            self.seq = snap.seq
            self.renders += 1


async def _healthz_during_renders(
    renderer: Any, run: Callable[[Subscription], Awaitable[None]]
) -> list[float]:
    bus = SnapshotBus()
    app = build_app(_Healthy(), renderer, CollectorRegistry(auto_describe=False))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    task = asyncio.create_task(run(bus.subscribe("render")))
    stop = asyncio.Event()

    base = snapshot(1)

    async def publish() -> None:
        # a snapshot every PUBLISH_EVERY (collections and XIDs), each scraped: renders run
        # back to back
        seq = 0
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                seq += 1
                bus.publish(dataclasses.replace(base, seq=seq))
                async with http.get(f"http://127.0.0.1:{port}/gpu/metrics") as resp:
                    await resp.read()
                await asyncio.sleep(PUBLISH_EVERY)

    publisher = asyncio.create_task(publish())
    latencies: list[float] = []
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/healthz"
            deadline = time.perf_counter() + POLL_SECONDS
            next_at = time.perf_counter()
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with http.get(url) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - started)
                next_at += 1 / POLL_HZ
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    finally:
        stop.set()
        publisher.cancel()
        task.cancel()
        await asyncio.gather(publisher, task, return_exceptions=True)
        bus.close()
        await runner.cleanup()
    return latencies


def _latency_rows(label: str, latencies: list[float], renders: int) -> list[Row]:
    ms = [x * 1000 for x in latencies]
    note = f"{renders} renders, {len(ms)} of {POLL_SECONDS * POLL_HZ:.0f} probes served"
    return [
        Row("serving", f"/healthz p50 during renders ({label})", percentile(ms, 50), "ms", note),
        Row(
            "serving",
            f"/healthz p99 during renders ({label})",
            percentile(ms, 99),
            "ms",
            "target < 20",
        ),
        Row("serving", f"/healthz max during renders ({label})", max(ms), "ms", ""),
    ]


async def run() -> list[Row]:
    rows = render_rows()
    on_loop = _OnLoop()
    latencies = await _healthz_during_renders(on_loop, on_loop.run)
    rows += _latency_rows("on the loop", latencies, on_loop.renders)
    renderer = MetricsRenderer(NAMING, (), object())
    renders: list[int] = []
    renderer.observer = lambda fmt, seq: renders.append(seq)
    latencies = await _healthz_during_renders(renderer, renderer.run)
    rows += _latency_rows("renderer", latencies, len(renders))
    return rows
