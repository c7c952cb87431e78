"""The /gpu/metrics renderer: off the loop, coalescing, ordered installs, lazy OpenMetrics."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.facts import GpuIdentity, GpuSample
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.serving.app import build_app
from gpuid_agent.serving.renderer import MetricsRenderer
from gpuid_agent.state.attribution.holders import Attribution, Holder
from gpuid_agent.state.bus import SnapshotBus
from gpuid_agent.state.health.verdicts import NodeHealth
from gpuid_agent.state.inventory import build_inventory
from gpuid_agent.state.snapshot import NodeSnapshot
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


@asynccontextmanager
async def running(
    naming: gpu_metrics.Naming = "prometheus",
) -> AsyncIterator[tuple[MetricsRenderer, SnapshotBus, Recorder]]:
    renderer = MetricsRenderer(naming, (), None)
    recorder = Recorder()
    renderer.observer = recorder
    bus = SnapshotBus()
    task = asyncio.create_task(renderer.run(bus.subscribe("render")))
    try:
        yield renderer, bus, recorder
    finally:
        for event in recorder.hold.values():
            event.set()
        bus.close()
        await asyncio.wait_for(task, 10)


async def test_renders_run_in_a_worker_thread_not_the_loop() -> None:
    loop_thread = threading.get_ident()
    async with running("dcgm") as (renderer, bus, recorder):
        bus.publish(snapshot(1))
        rendered = await asyncio.wait_for(renderer.wait_rendered(1), 10)
        assert temperature(rendered.text, "dcgm") == 1.0
        assert (await renderer.openmetrics()).endswith(b"# EOF\n")
    assert {f for f, _, _ in recorder.calls} == {"text", "openmetrics"}
    assert all(thread != loop_thread for _, _, thread in recorder.calls)


async def test_a_burst_coalesces_and_the_last_snapshot_is_installed() -> None:
    async with running() as (renderer, bus, recorder):
        started, release = recorder.gate(1)
        bus.publish(snapshot(1))
        await eventually(started.is_set)
        for seq in range(2, 51):  # all arrive while the first render runs
            bus.publish(snapshot(seq))
        release.set()
        rendered = await asyncio.wait_for(renderer.wait_rendered(50), 10)
        assert rendered.seq == renderer.seq == 50
        assert temperature(renderer.text()) == 50.0
        assert [seq for _, seq, _ in recorder.calls] == [1, 50]
        assert renderer.renders == 2


async def test_an_older_render_never_replaces_a_newer_one() -> None:
    renderer = MetricsRenderer("prometheus", (), None)
    recorder = Recorder()
    renderer.observer = recorder
    started, release = recorder.gate(2)
    slow = asyncio.create_task(renderer.render(snapshot(2)))
    await eventually(started.is_set)
    assert await renderer.render(snapshot(3)) is True
    release.set()
    assert await asyncio.wait_for(slow, 10) is False  # finished last, but is older
    assert renderer.seq == 3 and temperature(renderer.text()) == 3.0
    assert renderer.install(snapshot(3), b"same seq") is False
    assert temperature(renderer.current().text) == 3.0


async def test_nothing_rendered_yet_serves_empty_bodies() -> None:
    renderer = MetricsRenderer("prometheus", (), None)
    assert renderer.seq == 0 and renderer.text() == b""
    assert await renderer.openmetrics() == b"# EOF\n"


async def test_openmetrics_only_when_negotiated_and_once_per_snapshot() -> None:
    om = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with running() as (renderer, bus, recorder):
        app = build_app(Healthy(), renderer, CollectorRegistry(auto_describe=False))
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            bus.publish(snapshot(1))
            await asyncio.wait_for(renderer.wait_rendered(1), 10)
            for _ in range(3):
                resp = await client.get("/gpu/metrics")
                assert temperature(await resp.read()) == 1.0
            assert recorder.count("openmetrics") == 0

            # concurrent first scrapes share one render, held until all of them wait on it
            started, release = recorder.gate(1)
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
            assert [(f, s) for f, s, _ in recorder.calls if f == "openmetrics"] == [
                ("openmetrics", 1)
            ]

            bus.publish(snapshot(2))
            await asyncio.wait_for(renderer.wait_rendered(2), 10)
            assert recorder.count("openmetrics") == 1  # a new snapshot alone renders nothing
            text = await (await client.get("/gpu/metrics", headers=om)).text()
            families = {f.name: f for f in parse_om(text)}
            assert families["gpuid_gpu_temperature_celsius"].samples[0].value == 2.0
            assert recorder.count("openmetrics") == 2


async def test_a_scraper_hanging_up_does_not_cancel_the_shared_render() -> None:
    async with running() as (renderer, bus, recorder):
        bus.publish(snapshot(1))
        await asyncio.wait_for(renderer.wait_rendered(1), 10)
        started, release = recorder.gate(1)
        first = asyncio.create_task(renderer.openmetrics())
        await eventually(started.is_set)
        second = asyncio.create_task(renderer.openmetrics())
        await asyncio.sleep(0)
        first.cancel()
        release.set()
        assert (await asyncio.wait_for(second, 10)).endswith(b"# EOF\n")
        assert recorder.count("openmetrics") == 1


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


async def test_a_failed_render_keeps_the_last_body_and_the_next_one_is_tried() -> None:
    recorder = FailOn(("text", 2), ("openmetrics", 3))
    renderer = MetricsRenderer("prometheus", (), None)
    renderer.observer = recorder
    bus = SnapshotBus()
    task = asyncio.create_task(renderer.run(bus.subscribe("render")))
    try:
        bus.publish(snapshot(1))
        await asyncio.wait_for(renderer.wait_rendered(1), 10)
        bus.publish(snapshot(2))  # its render fails: snapshot 1 stays served
        await eventually(lambda: ("text", 2) in {(f, s) for f, s, _ in recorder.calls})
        bus.publish(snapshot(3))
        await asyncio.wait_for(renderer.wait_rendered(3), 10)
        assert temperature(renderer.text()) == 3.0 and not task.done()
        with pytest.raises(RuntimeError):
            await renderer.openmetrics()
        assert (await renderer.openmetrics()).endswith(b"# EOF\n")  # a failed try is not cached
        assert recorder.count("openmetrics") == 2
    finally:
        bus.close()
        await asyncio.wait_for(task, 10)
