"""The simulated node runs an in-process kubelet: pods on a shared GPU and on MIG devices."""

from __future__ import annotations

import asyncio
import io
import os

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from tests.conftest import running_agent, settings
from tests.test_attribution_agent import rendered_with_pods
from tests.waiting import eventually


async def test_simulated_mig_node_has_pods_on_a_shared_gpu_and_mig_devices() -> None:
    out = io.BytesIO()
    agent = Agent(
        settings(simulate="mig", pod_resources_interval=0.05), exporters=[StdoutExporter(out)]
    )
    async with running_agent(agent):
        socket_path = agent.environment.pod_resources_socket
        await eventually(lambda: rendered_with_pods(agent))
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/gpu/metrics") as resp,
        ):
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        await eventually(lambda: out.getvalue().count(b'"kind":"allocation"') >= 5)
        assert agent.board.is_ok("pod-resources")
    assert not await asyncio.to_thread(os.path.exists, socket_path)  # gone with the agent
    used = families["gpuid_gpu_memory_used_bytes"].samples
    profiles = {s.labels["gpu_instance_profile"] for s in used if s.labels["gpu_instance_id"]}
    assert profiles == {"3g.40gb", "2g.20gb", "1g.10gb"}  # held or not, each has its series
    info = families["gpuid_gpu_allocation_info"].samples
    mig = {
        s.labels["gpu_instance_profile"]: s.labels["pod"]
        for s in info
        if s.labels["gpu_instance_id"]
    }
    assert mig == {"3g.40gb": "mig-job-0", "2g.20gb": "mig-job-1"}
    shared = {s.labels["pod"] for s in info if s.labels["gpu"] == "1"}
    assert shared == {"llm-serve-0", "llm-serve-1", "llm-serve-2"}
    records = [orjson.loads(x) for x in out.getvalue().splitlines()]
    starts = [r for r in records if r["kind"] == "allocation" and r["event"] == "start"]
    assert {r["pod"] for r in starts} == {
        "mig-job-0",
        "mig-job-1",
        "llm-serve-0",
        "llm-serve-1",
        "llm-serve-2",
    }
