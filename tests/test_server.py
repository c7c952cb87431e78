from __future__ import annotations

import io
from typing import Any

import aiohttp
import orjson
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.nvml_backend import SimulatedNvml
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests.conftest import running_agent, settings
from tests.waiting import eventually


def _url(agent: Agent, path: str) -> str:
    return f"http://127.0.0.1:{agent.bound_port}{path}"


async def test_endpoints_on_a_simulated_gb200_node() -> None:
    out = io.BytesIO()
    s = settings(simulate="gb200x4", postgres_password="s3cret-pw")
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: out.getvalue().count(b'"kind":"reading"') >= 4)
        records = [orjson.loads(x) for x in out.getvalue().splitlines()]
        records = [r for r in records if r["kind"] == "reading"]
        assert len(records) == 4 and len({r["gpu"] for r in records}) == 2
        assert len({r["chassis"] for r in records}) == 1

        async with http.get(_url(agent, "/gpu/metrics")) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        info = families["gpuid_gpu_info"]
        assert len(info.samples) == 4
        assert {s.labels["serial"] for s in info.samples} == {r["gpu"] for r in records}
        assert {s.labels["device"] for s in info.samples} == {f"nvidia{i}" for i in range(4)}
        for name in (
            "gpuid_gpu_utilization_ratio",
            "gpuid_gpu_memory_used_bytes",
            "gpuid_gpu_memory_total_bytes",
            "gpuid_gpu_temperature_celsius",
            "gpuid_gpu_power_watts",
        ):
            assert len(families[name].samples) == 4, name

        async with http.get(
            _url(agent, "/gpu/metrics"), headers={"Accept": "application/openmetrics-text"}
        ) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = await resp.text()
            assert text.endswith("# EOF\n")
            assert any(f.name == "gpuid_gpu_info" for f in parse_om(text))

        async with http.get(_url(agent, "/metrics")) as resp:
            own = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        assert own["gpuid_gpus"].samples[0].value == 4
        assert own["gpuid_build_info"].samples[0].value == 1
        delivered = [s for s in own["gpuid_export_success"].samples if s.name.endswith("_total")]
        assert delivered[0].labels == {"exporter": "stdout"} and delivered[0].value >= 1
        assert "gpuid_collection_duration_seconds" in own
        assert "gpuid_queue_depth" in own

        async with http.get(_url(agent, "/healthz")) as resp:
            assert resp.status == 200
        async with http.get(_url(agent, "/readyz")) as resp:
            assert resp.status == 200
        async with http.get(_url(agent, "/status")) as resp:
            raw = await resp.read()
            status = orjson.loads(raw)
        assert b"s3cret-pw" not in raw
        assert status["config"]["postgres_password"] == "<redacted>"
        assert status["inventory"]["gpu_count"] == 4
        assert len(status["inventory"]["chassis"]) == 1
        assert status["components"]["nvml"]["state"] == "ok"
        gpu0 = status["inventory"]["gpus"][0]
        assert gpu0["platform"]["tray_index"] == 3 and gpu0["module_id"] == 1


async def test_dcgm_naming() -> None:
    s = settings(simulate="h100x8", metrics_naming="dcgm")
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(io.BytesIO())])) as agent,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: agent.renderer.seq >= 1)  # the first render is installed
        async with http.get(_url(agent, "/gpu/metrics")) as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    used = families["DCGM_FI_DEV_FB_USED"].samples
    # dcgm layout: one series per GPU and holder pod (the simulated kubelet shares GPU 0)
    assert len({s.labels["UUID"] for s in used}) == 8
    assert {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"} <= set(used[0].labels)
    assert used[0].labels["Hostname"] == "node-a"
    total = families["DCGM_FI_DEV_FB_TOTAL"].samples[0].value
    assert total == 81559  # MiB, as dcgm-exporter reports it


async def test_no_driver_keeps_serving_and_is_not_ready() -> None:
    s = settings()
    api = PynvmlApi("/nonexistent/driver/libnvidia-ml.so.1")
    async with (
        running_agent(Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])) as agent,
        aiohttp.ClientSession() as http,
    ):
        await eventually(lambda: agent.board.get("nvml").state == "unavailable")  # type: ignore[union-attr]
        async with http.get(_url(agent, "/healthz")) as resp:
            assert resp.status == 200
        async with http.get(_url(agent, "/readyz")) as resp:
            assert resp.status == 503
            body = await resp.json()
        assert any("cannot load NVML library" in p for p in body["problems"])
        async with http.get(_url(agent, "/status")) as resp:
            status = await resp.json()
        assert status["components"]["nvml"]["state"] == "unavailable"
        assert "/nonexistent/driver" in status["components"]["nvml"]["reason"]
        async with http.get(_url(agent, "/gpu/metrics")) as resp:
            assert resp.status == 200


async def test_a_dead_task_fails_liveness() -> None:
    async def boom() -> None:
        raise RuntimeError("kaput")

    s = settings(simulate="h100x8")
    async with (
        running_agent(Agent(s, exporters=[StdoutExporter(io.BytesIO())])) as agent,
        aiohttp.ClientSession() as http,
    ):
        agent.supervisor.spawn("extra", boom())

        async def unhealthy() -> Any:
            async with http.get(_url(agent, "/healthz")) as resp:
                return await resp.json() if resp.status == 503 else None

        body = await eventually(unhealthy)
        assert "task extra RuntimeError: kaput" in body["problems"]


async def test_lost_gpu_keeps_its_identity_and_degrades() -> None:
    api = SimulatedNvml("h100x8", "node-a")
    s = settings(simulate="h100x8")
    async with running_agent(
        Agent(s, nvml_api=api, exporters=[StdoutExporter(io.BytesIO())])
    ) as agent:
        await eventually(lambda: agent.bus.latest is not None)
        uuids = [g.uuid for g in agent.bus.latest.inventory.gpus]  # type: ignore[union-attr]
        api.gpus[2].lost = True
        await eventually(lambda: agent.board.get("nvml").state == "degraded")  # type: ignore[union-attr]
        assert [g.uuid for g in agent.bus.latest.inventory.gpus] == uuids  # type: ignore[union-attr]
        assert "GPU 2" in (agent.board.get("nvml").reason or "")  # type: ignore[union-attr]
        api.gpus[2].lost = False
        await eventually(lambda: agent.board.get("nvml").state == "ok")  # type: ignore[union-attr]
