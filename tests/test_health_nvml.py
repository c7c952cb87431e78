"""GPU health through the real pynvml and the fake libnvidia-ml.so.1, with a running agent;
the kubelet's allocatable GPUs from its own pod-resources server (Go, `real_kubelet`). No
stand-in: the API server is not used, and the kubelet answers normally."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pynvml
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.serving import gpu_metrics
from gpuid_agent.sources.nvml.health import HealthReader
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from gpuid_agent.sources.nvml.source import NvmlSource
from gpuid_agent.state.health.tracker import HealthTracker
from tests import fakenvml
from tests.conftest import node_health, running_agent, settings
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually


class Run:
    """A running agent on the fake library, with what it exported and served."""

    def __init__(self, agent: Agent, out: io.BytesIO, http: aiohttp.ClientSession) -> None:
        self.agent = agent
        self.out = out
        self.http = http
        self.url = f"http://127.0.0.1:{agent.bound_port}"

    def records(self, kind: str) -> list[dict[str, Any]]:
        rows = [orjson.loads(line) for line in self.out.getvalue().splitlines()]
        return [r for r in rows if r["kind"] == kind]

    def health(self, kind: str = "health", **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.records(kind) if all(r[k] == v for k, v in match.items())]

    async def settled_health(self, n: int, **match: Any) -> list[dict[str, Any]]:
        """The health records matching, once n arrived and a few more ticks brought no more."""
        await eventually(lambda: len(self.health(**match)) >= n)
        await self.wait_ticks(5)
        return self.health(**match)

    def check(self, index: int, name: str) -> Any:
        gpus = node_health(self.agent).gpus
        return next((g.checks.get(name) for g in gpus if g.index == index), None)

    def ticks(self) -> float:
        value = self.agent.metrics.registry.get_sample_value(
            "gpuid_collection_duration_seconds_count"
        )
        return value or 0.0

    async def wait_ticks(self, n: int) -> None:
        target = self.ticks() + n
        await eventually(lambda: self.ticks() >= target)

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as resp:
            body = await resp.read()
            is_json = resp.content_type == "application/json"
            return resp.status, orjson.loads(body) if is_json else body.decode()


@asynccontextmanager
async def agent_on(
    fake: FakeNvml, config: fakenvml.FakeNvmlConfig, **overrides: Any
) -> AsyncIterator[Run]:
    fake.apply(config)
    s = settings(
        nvml_library_path=str(overrides.pop("lib", fake.lib_path)),
        health_window=overrides.pop("health_window", 0.4),
        **overrides,
    )
    out = io.BytesIO()
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent,
        aiohttp.ClientSession() as http,
    ):
        run = Run(agent, out, http)
        await eventually(lambda: len(node_health(agent).gpus) == len(config.gpus))
        yield run


def _metrics(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_xid_79_makes_that_gpu_unhealthy_and_everything_else_carries_on(
    fake_nvml: FakeNvml,
) -> None:
    config = fakenvml.gb200x4()
    async with agent_on(fake_nvml, config, heartbeat_interval=0.2) as run:
        await eventually(
            lambda: run.agent.collector.health.xid.alive and len(run.records("reading")) >= 4
        )
        assert all(g.state == "healthy" for g in node_health(run.agent).gpus)
        config.gpus[2].xids.append((79, 0))
        fake_nvml.apply(config)  # the trigger: the next wait delivers it

        xid = await eventually(
            lambda: run.check(2, "xid") if run.check(2, "xid").state == "unhealthy" else None
        )
        assert xid.action == "reboot" and "fallen off the bus" in xid.reason
        readings_then = len(run.records("reading"))
        await run.wait_ticks(20)

        snap = node_health(run.agent)
        assert [g.state for g in snap.gpus] == ["healthy", "healthy", "unhealthy", "healthy"]
        assert snap.gpus[2].action == "reboot" and snap.gpus[2].xid_counts == {79: 1}
        [record] = await run.settled_health(1, check="xid")  # one, however many ticks passed
        assert record["uuid"] == config.gpus[2].uuid and record["index"] == 2
        assert (record["state"], record["previous_state"], record["action"]) == (
            "unhealthy",
            "healthy",
            "reboot",
        )
        assert record["gpu"] == config.gpus[2].serial and record["chassis"] == "1821324190123"
        assert record["cluster"] == "test" and record["node"] == "node-a"
        assert len(record["record_id"]) == 32 and record["gpu_state"] == "unhealthy"
        assert run.health() == [record]
        await eventually(lambda: len(run.records("reading")) > readings_then)  # still flowing

        status, ready = await run.get("/readyz")
        assert status == 200 and ready["ok"]  # the agent is fine although a GPU is not
        assert (await run.get("/healthz"))[0] == 200
        status, body = await run.get("/status")
        gpu2 = body["health"]["gpus"][2]
        assert gpu2["state"] == "unhealthy" and gpu2["checks"]["xid"]["since"]
        assert gpu2["xid_counts"] == {"79": 1}
        assert body["health"]["gpus"][0]["state"] == "healthy"

        _, text = await run.get("/gpu/metrics")
        families = _metrics(text)
        # the declared names (docs, chart checks) cover every family really served
        declared = set(gpu_metrics.metric_names("prometheus"))
        assert {
            f.name + ("_total" if f.type == "counter" else "") for f in families.values()
        } <= declared
        xids = [s for s in families["gpuid_gpu_xid_errors"].samples if s.name.endswith("_total")]
        assert [(s.labels["gpu"], s.labels["xid"], s.value) for s in xids] == [("2", "79", 1.0)]
        overall = {
            s.labels["gpu"]: (s.labels["state"], s.labels["action"])
            for s in families["gpuid_gpu_health_state"].samples
            if s.labels["check"] == "overall"
        }
        assert overall == {
            "0": ("healthy", "none"),
            "1": ("healthy", "none"),
            "2": ("unhealthy", "reboot"),
            "3": ("healthy", "none"),
        }


async def test_remapped_rows_pending_then_failed_then_cleared(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    async with agent_on(fake_nvml, config) as run:
        config.gpus[1].remap_pending = 1
        fake_nvml.apply(config)
        pending = await eventually(
            lambda: (
                run.check(1, "remapped_rows")
                if run.check(1, "remapped_rows").state == "degraded"
                else None
            )
        )
        assert pending.action == "reset" and "when convenient" in pending.reason
        config.gpus[1].remap_failure = 1
        fake_nvml.apply(config)
        await eventually(lambda: run.check(1, "remapped_rows").action == "hardware_inspection")
        config.gpus[1].remap_pending = config.gpus[1].remap_failure = 0
        fake_nvml.apply(config)
        await eventually(lambda: run.check(1, "remapped_rows").state == "healthy")
        rows = await run.settled_health(3, check="remapped_rows")
        assert [(r["state"], r["action"], r["index"]) for r in rows] == [
            ("degraded", "reset", 1),
            ("unhealthy", "hardware_inspection", 1),
            ("healthy", "none", 1),
        ]
        assert all(g.state == "healthy" for g in node_health(run.agent).gpus)


async def test_ecc_growth_degrades_and_clears_after_the_window(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    async with agent_on(fake_nvml, config, health_window=0.3) as run:
        await run.wait_ticks(2)
        config.gpus[4].ecc_vol_corr = 7
        fake_nvml.apply(config)
        ecc = await eventually(
            lambda: run.check(4, "ecc") if run.check(4, "ecc").state == "degraded" else None
        )
        assert "7 new corrected ECC errors" in ecc.reason and ecc.action == "none"
        await eventually(lambda: run.check(4, "ecc").state == "healthy")  # no more growth
        assert [(r["state"], r["index"]) for r in await run.settled_health(2, check="ecc")] == [
            ("degraded", 4),
            ("healthy", 4),
        ]
        config.gpus[4].ecc_vol_uncorr = 1
        fake_nvml.apply(config)
        await eventually(lambda: run.check(4, "ecc").state == "unhealthy")
        assert run.check(4, "ecc").action == "reboot"


async def test_gpu_lost_mid_run_is_reported_and_recovers(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    async with agent_on(fake_nvml, config) as run:
        await run.wait_ticks(2)
        config.gpus[5].lost = True
        fake_nvml.apply(config)
        lost = await eventually(
            lambda: run.check(5, "lost") if run.check(5, "lost").state == "unhealthy" else None
        )
        assert lost.action == "reboot" and "lost" in lost.reason
        await run.wait_ticks(10)  # no crash, no repeats while it stays lost
        assert (await run.get("/healthz"))[0] == 200
        assert (await run.get("/readyz"))[0] == 200
        _, body = await run.get("/status")
        assert body["health"]["gpus"][5]["checks"]["lost"]["state"] == "unhealthy"
        assert body["health"]["gpus"][5]["checks"]["ecc"]["state"] == "healthy"  # last known
        config.gpus[5].lost = False
        fake_nvml.apply(config)
        await eventually(lambda: run.check(5, "lost").state == "healthy")
        assert [(r["check"], r["state"], r["index"]) for r in await run.settled_health(2)] == [
            ("lost", "unhealthy", 5),
            ("lost", "healthy", 5),
        ]


async def test_reset_required_on_any_call_counts_as_lost(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus[3].errors["ecc"] = pynvml.NVML_ERROR_RESET_REQUIRED  # identity reads still work
    async with agent_on(fake_nvml, config) as run:
        lost = await eventually(
            lambda: run.check(3, "lost") if run.check(3, "lost").state == "unhealthy" else None
        )
        assert lost.reason == "GPU requires a reset"
        # a reset-required GPU is a health finding, not an NVML outage
        await eventually(lambda: run.agent.board.is_ok("nvml"))


async def test_expected_gpu_count(fake_nvml: FakeNvml) -> None:
    config = fakenvml.gb200x4()
    async with agent_on(fake_nvml, config, expected_gpu_count=8) as run:
        count = await eventually(lambda: node_health(run.agent).node_checks.get("gpu_count"))
        assert (count.state, count.action) == ("unhealthy", "reboot")
        assert "4 of 8" in count.reason
        [record] = await run.settled_health(1, check="gpu_count")
        assert record["uuid"] is None and record["gpu"] == "" and record["state"] == "unhealthy"
        _, text = await run.get("/gpu/metrics")
        [node] = _metrics(text)["gpuid_node_health_state"].samples
        assert (node.labels["check"], node.labels["state"]) == ("gpu_count", "unhealthy")


@pytest.mark.parametrize(
    ("offered", "state"),
    [(("0", "1", "2", "3"), "healthy"), (("0", "1", "2", "3", "4"), "unhealthy")],
)
async def test_expected_count_from_the_kubelets_allocatable_gpus(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, offered: tuple[str, ...], state: str
) -> None:
    """EXPECTED_GPU_COUNT=-1 holds NVML's count to the GPUs the kubelet can allocate (by GPU
    index here, as some device plugins name them); a GPU the kubelet still offers but NVML no
    longer shows is the finding."""
    real_kubelet.allocatable = (("nvidia.com/gpu", offered),)
    real_kubelet.publish()
    async with agent_on(
        fake_nvml,
        fakenvml.gb200x4(),
        pod_resources_socket=real_kubelet.socket_path,
        expected_gpu_count=-1,
    ) as run:
        check = await eventually(
            lambda: (
                (c := node_health(run.agent).node_checks.get("gpu_count"))
                and c.state == state
                and c
            )
        )
        assert ("kubelet allocatable" in (check.reason or "")) == (state == "unhealthy")


async def test_persistence_off_and_clock_slowdowns(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    async with agent_on(fake_nvml, config) as run:
        config.gpus[0].persistence_mode = 0
        config.gpus[6].clocks_event_reasons = 0x1 | 0x8 | 0x40  # idle + HW thermal
        fake_nvml.apply(config)
        await eventually(lambda: run.check(6, "clock_events").state == "degraded")
        assert "hardware thermal" in run.check(6, "clock_events").reason
        assert run.check(6, "clock_events").action == "hardware_inspection"
        assert (run.check(0, "persistence").state, run.check(0, "persistence").action) == (
            "degraded",
            "none",
        )
        config.gpus[6].clocks_event_reasons = 0x1
        fake_nvml.apply(config)
        await eventually(lambda: run.check(6, "clock_events").state == "healthy")


async def test_driver_without_event_api_says_xid_not_supported(fake_nvml: FakeNvml) -> None:
    lib = fake_nvml.build(omit=["nvmlEventSetCreate"])
    fake_nvml.load(lib)
    async with agent_on(fake_nvml, fakenvml.h100x8(), lib=lib) as run:
        xid = await eventually(
            lambda: run.check(0, "xid") if run.check(0, "xid").state == "not_supported" else None
        )
        assert "Function Not Found" in xid.reason
        assert all(g.state == "healthy" for g in node_health(run.agent).gpus)
        # the XID watcher can report before the first collection has made NVML ready
        await eventually(lambda: run.agent.board.is_ok("nvml"))
        assert run.agent.board.get("health").state == "degraded"  # type: ignore[union-attr]
        assert (await run.get("/readyz"))[0] == 200


async def test_a_gpu_without_xid_events_says_so(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus[7].supported_events = 0x1  # no nvmlEventTypeXidCriticalError
    config.gpus[0].xids.append((48, 5))  # delivered by the sixth wait
    async with agent_on(fake_nvml, config) as run:
        await eventually(lambda: run.check(7, "xid").state == "not_supported")
        await eventually(lambda: run.check(0, "xid").state == "unhealthy")
        assert "double-bit ECC" in run.check(0, "xid").reason
        assert run.check(3, "xid").state == "healthy"


async def _health_of(fake: FakeNvml, config: fakenvml.FakeNvmlConfig, lib: str) -> Any:
    """One read and one evaluation, through NvmlSource's thread, without an agent."""
    fake.apply(config)
    api = PynvmlApi(lib)
    source = NvmlSource(api)
    await source.init()
    try:
        reading = await source.read()
        targets = {g.index: g.uuid for g in reading.gpus}
        signals = await source.run(lambda: HealthReader(api).read(targets))
    finally:
        await source.close()
    tracker = HealthTracker()
    tracker.observe(reading.gpus, signals, reading.lost)
    return tracker.snapshot()


async def test_fabric_check_and_a_driver_without_the_fabric_call(fake_nvml: FakeNvml) -> None:
    gb200 = fakenvml.gb200x4()
    healthy_mask = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8 | 1 << 12 | 1 << 14
    for gpu in gb200.gpus:
        gpu.fabric_health_mask = healthy_mask
    gb200.gpus[1].fabric_health_mask = (healthy_mask & ~0x3) | 1  # degraded bandwidth
    snap = await _health_of(fake_nvml, gb200, str(fake_nvml.lib_path))
    assert [g.checks["fabric"].state for g in snap.gpus] == [
        "healthy",
        "degraded",
        "healthy",
        "healthy",
    ]
    assert snap.gpus[1].checks["fabric"].action == "hardware_inspection"

    old = fake_nvml.build(omit=["nvmlDeviceGetGpuFabricInfoV"])
    fake_nvml.load(old)
    snap = await _health_of(fake_nvml, gb200, str(old))
    for gpu in snap.gpus:
        assert gpu.checks["fabric"].state == "not_supported"
        assert gpu.checks["fabric"].reason == "the driver lacks this NVML call"
        assert gpu.state == "healthy"


async def test_fabric_v2_structure_on_drivers_without_the_health_summary(
    fake_nvml: FakeNvml,
) -> None:
    gb200 = fakenvml.gb200x4()
    for gpu in gb200.gpus:
        gpu.fabric_max_version = 2  # a driver that predates the v3 structure
        gpu.fabric_health_summary = 2  # "unhealthy", but a v2 caller never sees it
    gb200.gpus[0].fabric_state = 2  # registration still in progress
    gb200.gpus[3].fabric_health_mask = 1  # degraded bandwidth: the mask is in v2 already
    snap = await _health_of(fake_nvml, gb200, str(fake_nvml.lib_path))
    assert [g.checks["fabric"].state for g in snap.gpus] == [
        "degraded",
        "healthy",
        "healthy",
        "degraded",
    ]
    assert "in progress" in (snap.gpus[0].checks["fabric"].reason or "")
    assert "bandwidth" in (snap.gpus[3].checks["fabric"].reason or "")
    gb200.gpus[1].fabric_max_version = 3  # a v3 driver reports the summary
    snap = await _health_of(fake_nvml, gb200, str(fake_nvml.lib_path))
    assert snap.gpus[1].checks["fabric"].state == "unhealthy"
    h100 = await _health_of(fake_nvml, fakenvml.h100x8(), str(fake_nvml.lib_path))
    assert {g.checks["fabric"].state for g in h100.gpus} == {"not_supported"}


async def test_unknown_nvml_errors_make_a_check_unknown_not_a_crash(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus[2].errors["remapped_rows"] = 999  # NVML_ERROR_UNKNOWN
    config.gpus[2].errors["persistence_mode"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    config = dataclasses.replace(config)
    snap = await _health_of(fake_nvml, config, str(fake_nvml.lib_path))
    checks = snap.gpus[2].checks
    assert checks["remapped_rows"].state == "unknown"
    assert "Unknown Error" in (checks["remapped_rows"].reason or "")
    assert checks["persistence"].state == "not_supported"
    assert snap.gpus[2].state == "healthy"


async def test_an_xid_of_a_gpu_lost_at_start_is_seen_once_it_returns(fake_nvml: FakeNvml) -> None:
    config = fakenvml.h100x8()
    config.gpus[1].lost = True
    config.gpus[1].xids.append((95, 0))
    async with agent_on(fake_nvml, config, expected_gpu_count=8) as run:
        lost = await eventually(lambda: run.check(1, "lost"))
        assert lost.state == "unhealthy"
        assert node_health(run.agent).gpus[1].uuid == "unknown-gpu-1"  # never read yet
        assert node_health(run.agent).node_checks["gpu_count"].state == "unhealthy"
        config.gpus[1].lost = False
        fake_nvml.apply(config)
        await eventually(lambda: run.check(1, "xid").state == "unhealthy")
        gpu1 = node_health(run.agent).gpus[1]
        assert gpu1.uuid == config.gpus[1].uuid and gpu1.checks["lost"].state == "healthy"
        records = await run.settled_health(5)
        assert sorted((r["uuid"] or "", r["check"], r["state"]) for r in records) == [
            ("", "gpu_count", "healthy"),
            ("", "gpu_count", "unhealthy"),
            (config.gpus[1].uuid, "lost", "healthy"),
            (config.gpus[1].uuid, "xid", "unhealthy"),
            ("unknown-gpu-1", "lost", "unhealthy"),
        ]
