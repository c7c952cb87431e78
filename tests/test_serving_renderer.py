"""The /gpu/metrics renderer: pages rendered off the loop when scraped (or just before a scrape
is due), once per snapshot and format, never for a snapshot nobody scrapes."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.facts import GpuIdentity, GpuSample
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.app import build_app
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot
from tests.conftest import running_agent, settings
from tests.waiting import eventually

UUID = "GPU-00000000-0000-4000-8000-000000000000"


def snapshot(seq: int) -> NodeSnapshot:
    """One GPU held by one pod; the temperature is the seq, so a body says which it came from."""
    inventory = build_inventory(
        [GpuIdentity(index=0, uuid=UUID, name="H100")],
        node="node-a",
        cluster="c",
        machine="m",
        machine_source="test",
        driver_version="570",
        cuda_driver_version=None,
        read_time=datetime.now(UTC),
    )
    return NodeSnapshot(
        seq=seq,
        cause="collection",
        inventory=inventory,
        samples={UUID: GpuSample(UUID, {"temperature_celsius": float(seq)})},
        health=NodeHealth(),
        attribution=Attribution("current", by_device={UUID: (Holder("ns", "pod", "main"),)}),
    )


def temperature(text: bytes, naming: gpu_metrics.Naming = "prometheus") -> float:
    name = "gpuid_gpu_temperature_celsius" if naming == "prometheus" else "DCGM_FI_DEV_GPU_TEMP"
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    return float(families[name].samples[0].value)


class Recorder:
    """Records (format, seq, thread) of every render; `hold` blocks renders of given seqs."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.hold: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}

    def __call__(self, fmt: str, seq: int) -> None:
        self.calls.append((fmt, seq, threading.get_ident()))
        if seq in self.started:
            self.started[seq].set()
        if seq in self.hold:
            assert self.hold[seq].wait(10), "held render never released"

    def count(self, fmt: str) -> int:
        return sum(1 for f, _, _ in self.calls if f == fmt)

    def gate(self, seq: int) -> tuple[threading.Event, threading.Event]:
        self.started[seq], self.hold[seq] = threading.Event(), threading.Event()
        return self.started[seq], self.hold[seq]


class Running:
    """A renderer fed by a bus, its render observer and the registry its renders are counted in."""

    def __init__(self, naming: gpu_metrics.Naming, recorder: Recorder) -> None:
        self.metrics = AgentMetrics()
        self.renderer = MetricsRenderer(naming, (), None, self.metrics.render_duration)
        self.recorder = recorder
        self.renderer.observer = recorder
        self.bus = SnapshotBus()

    def renders(self, fmt: gpu_metrics.Format = "text") -> float:
        """gpuid_gpu_metrics_render_duration_seconds_count of `fmt`, as /metrics shows it."""
        name = "gpuid_gpu_metrics_render_duration_seconds_count"
        value = self.metrics.registry.get_sample_value(name, {"format": fmt})
        assert value is not None
        return value

    async def publish(self, *seqs: int) -> None:
        """Publish each snapshot and let the renderer's task take it before the next."""
        for seq in seqs:
            self.bus.publish(snapshot(seq))
            await asyncio.sleep(0)


@asynccontextmanager
async def running(
    naming: gpu_metrics.Naming = "prometheus", recorder: Recorder | None = None
) -> AsyncIterator[Running]:
    r = Running(naming, recorder or Recorder())
    task = asyncio.create_task(r.renderer.run(r.bus.subscribe("render")))
    try:
        yield r
    finally:
        for event in r.recorder.hold.values():
            event.set()
        r.bus.close()
        await asyncio.wait_for(task, 10)


async def test_renders_run_in_a_worker_thread_not_the_loop() -> None:
    loop_thread = threading.get_ident()
    async with running("dcgm") as r:
        await r.publish(1)
        assert temperature(await r.renderer.body("text"), "dcgm") == 1.0
        assert (await r.renderer.body("openmetrics")).endswith(b"# EOF\n")
    assert {f for f, _, _ in r.recorder.calls} == {"text", "openmetrics"}
    assert all(thread != loop_thread for _, _, thread in r.recorder.calls)


async def test_snapshots_nobody_scrapes_are_never_rendered() -> None:
    async with running() as r:
        await r.publish(*range(1, 51))
        assert r.renderer.seq == 50
        assert r.recorder.calls == [] and r.renders("text") == r.renders("openmetrics") == 0
        assert temperature(await r.renderer.body("text")) == 50.0  # the newest, rendered now
        assert [(f, seq) for f, seq, _ in r.recorder.calls] == [("text", 50)]
        assert r.renders("text") == 1


async def test_concurrent_scrapes_of_one_snapshot_share_one_render() -> None:
    waiting = 0

    @web.middleware
    async def count_waiting(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        nonlocal waiting
        waiting += 1
        try:
            return await handler(request)
        finally:
            waiting -= 1

    async with running() as r:
        registry = CollectorRegistry(auto_describe=False)
        app = build_app(Healthy(), r.renderer, registry, middlewares=[count_waiting])
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await r.publish(1)
            started, release = r.recorder.gate(1)
            scrapes = [asyncio.create_task(client.get("/gpu/metrics")) for _ in range(5)]
            await eventually(lambda: started.is_set() and waiting == 5)  # all on one render
            release.set()
            bodies = [await (await s).read() for s in scrapes]
            assert len(set(bodies)) == 1 and temperature(bodies[0]) == 1.0
            assert r.renders("text") == 1
            for _ in range(3):  # later scrapes of the same snapshot reuse its bytes
                assert await (await client.get("/gpu/metrics")).read() == bodies[0]
            assert r.renders("text") == 1 and len(r.recorder.calls) == 1


async def test_a_scrape_sees_the_last_snapshot_published_before_it() -> None:
    async with running() as r:
        await r.publish(1)
        assert temperature(await r.renderer.body("text")) == 1.0
        r.bus.publish(snapshot(2))  # the renderer's task has not run since
        assert temperature(await r.renderer.body("text")) == 2.0

        started, release = r.recorder.gate(3)
        await r.publish(3)
        first = asyncio.create_task(r.renderer.body("text"))
        await eventually(started.is_set)
        await r.publish(4)  # while snapshot 3 renders: a scrape from now on gets 4
        assert temperature(await r.renderer.body("text")) == 4.0
        release.set()
        assert temperature(await asyncio.wait_for(first, 10)) == 3.0  # it came before 4
        assert [seq for _, seq, _ in r.recorder.calls] == [1, 2, 3, 4]


async def test_nothing_published_serves_empty_bodies() -> None:
    async with running() as r:
        assert r.renderer.seq == 0
        assert await r.renderer.body("text") == b""
        assert await r.renderer.body("openmetrics") == b"# EOF\n"
        assert r.recorder.calls == []


async def test_openmetrics_only_when_negotiated_and_once_per_snapshot() -> None:
    om = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with running() as r:
        app = build_app(Healthy(), r.renderer, CollectorRegistry(auto_describe=False))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await r.publish(1)
            for _ in range(3):
                resp = await client.get("/gpu/metrics")
                assert temperature(await resp.read()) == 1.0
            assert r.recorder.count("openmetrics") == 0 and r.recorder.count("text") == 1

            started, release = r.recorder.gate(1)
            scrapes = [
                asyncio.create_task(client.get("/gpu/metrics", headers=om)) for _ in range(5)
            ]
            await eventually(started.is_set)
            release.set()
            bodies = [await (await s).text() for s in scrapes]
            assert len(set(bodies)) == 1 and bodies[0].endswith("# EOF\n")
            assert any(f.name == "gpuid_gpu_temperature_celsius" for f in parse_om(bodies[0]))
            resp = await client.get("/gpu/metrics", headers=om)
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert await resp.text() == bodies[0]
            assert r.recorder.count("openmetrics") == 1 and r.renders("openmetrics") == 1

            await r.publish(2)
            assert r.recorder.count("openmetrics") == 1  # a new snapshot alone renders nothing
            text = await (await client.get("/gpu/metrics", headers=om)).text()
            families = {f.name: f for f in parse_om(text)}
            assert families["gpuid_gpu_temperature_celsius"].samples[0].value == 2.0
            assert r.recorder.count("openmetrics") == 2 and r.recorder.count("text") == 1


async def test_a_scraper_hanging_up_does_not_cancel_the_shared_render() -> None:
    async with running() as r:
        await r.publish(1)
        started, release = r.recorder.gate(1)
        first = asyncio.create_task(r.renderer.body("openmetrics"))
        await eventually(started.is_set)
        second = asyncio.create_task(r.renderer.body("openmetrics"))
        await asyncio.sleep(0)
        first.cancel()
        release.set()
        assert (await asyncio.wait_for(second, 10)).endswith(b"# EOF\n")
        assert r.recorder.count("openmetrics") == 1


class Healthy:
    def liveness(self) -> tuple[bool, list[str]]:
        return True, []

    def readiness(self) -> tuple[bool, list[str]]:
        return True, []

    def status(self) -> dict[str, Any]:
        return {}


class FailOn(Recorder):
    """Fails the first render of the given (format, seq) pairs, as a render bug would."""

    def __init__(self, *failing: tuple[str, int]) -> None:
        super().__init__()
        self.failing = set(failing)

    def __call__(self, fmt: str, seq: int) -> None:
        super().__call__(fmt, seq)
        if (fmt, seq) in self.failing:
            self.failing.discard((fmt, seq))
            raise RuntimeError(f"render of {fmt} {seq} failed")


async def test_a_failed_render_keeps_the_last_text_page_and_the_next_scrape_tries_again() -> None:
    async with running(recorder=FailOn(("text", 2), ("openmetrics", 3))) as r:
        await r.publish(1)
        assert temperature(await r.renderer.body("text")) == 1.0
        await r.publish(2)  # its render fails: the page of snapshot 1 is served meanwhile
        assert temperature(await r.renderer.body("text")) == 1.0
        assert temperature(await r.renderer.body("text")) == 2.0  # tried again, and served
        await r.publish(3)
        with pytest.raises(RuntimeError):
            await r.renderer.body("openmetrics")  # no OpenMetrics page of an older snapshot
        assert (await r.renderer.body("openmetrics")).endswith(b"# EOF\n")  # not cached
        assert [(f, seq) for f, seq, _ in r.recorder.calls] == [
            ("text", 1),
            ("text", 2),
            ("text", 2),
            ("openmetrics", 3),
            ("openmetrics", 3),
        ]


async def test_a_steady_scraper_finds_each_page_rendered_before_it_comes() -> None:
    scraper, interval = "10.0.0.9", 1.1
    async with running() as r:
        await r.publish(1)
        await r.renderer.body("text")  # rendered before the scraper comes: its scrapes cost alike
        for n in range(3):
            if n:
                await asyncio.sleep(interval)  # the scraper's own interval, two gaps alike
            await r.renderer.body("text", scraper)
        assert r.recorder.count("text") == 1
        # the next scrape is nearer than the gap before this snapshot: rendered as it arrives
        await r.publish(2)
        await eventually(lambda: ("text", 2) in {(f, s) for f, s, _ in r.recorder.calls})
        # another comes before that scrape: rendered just before it is due, not as it arrives
        await r.publish(3)
        assert r.recorder.count("text") == 2
        await eventually(lambda: ("text", 3) in {(f, s) for f, s, _ in r.recorder.calls})
        assert temperature(await r.renderer.body("text", scraper)) == 3.0  # ready: no render
        assert r.recorder.count("text") == r.renders("text") == 3


async def test_an_agent_renders_only_the_snapshots_scraped() -> None:
    def rendered(text: str) -> float:
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["gpuid_gpu_metrics_render_duration_seconds"].samples
        counts = {s.labels["format"]: s.value for s in samples if s.name.endswith("_count")}
        return counts["text"] + counts["openmetrics"]

    agent = Agent(settings(simulate="h100x8"), exporters=[StdoutExporter(io.BytesIO())])
    async with running_agent(agent), aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{agent.bound_port}"
        await eventually(lambda: agent.bus.latest is not None and agent.bus.latest.seq >= 20)
        async with http.get(f"{base}/metrics") as resp:
            assert rendered(await resp.text()) == 0  # 20 snapshots, none scraped
        async with http.get(f"{base}/gpu/metrics") as resp:
            assert b"gpuid_gpu_info{" in await resp.read()
        async with http.get(f"{base}/metrics") as resp:
            assert rendered(await resp.text()) == 1
