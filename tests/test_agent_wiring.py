"""The wiring root: one snapshot reaches every consumer, gauges move without anyone probing,
and the simulated node sets itself up behind one call."""

from __future__ import annotations

import io

import orjson

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.setup.environment import node_environment
from gpuid_agent.simulate.node import SimulatedNode
from gpuid_agent.sources.host import HostNode
from gpuid_agent.sources.kubelet import PodResourcesClient
from tests.conftest import running_agent, settings
from tests.waiting import eventually


def readings(out: io.BytesIO) -> list[dict[str, object]]:
    lines = [orjson.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    return [r for r in lines if r.get("kind") == "reading"]


async def test_every_consumer_reads_the_same_snapshot() -> None:
    out = io.BytesIO()
    s = settings(simulate="gb200x4", heartbeat_interval=3600)
    async with running_agent(Agent(s, exporters=[StdoutExporter(out)])) as agent:
        await eventually(lambda: agent.renderer.seq >= 3 and len(readings(out)) >= 4)
        await agent.supervisor.stop("collector", "attribution", "pod-resources")
        last = agent.bus.latest
        assert last is not None
        await eventually(lambda: agent.renderer.seq == last.seq)
        text = (await agent.renderer.rendered()).text.decode()
        status = agent.page.status()
        for gpu in last.inventory.gpus:
            assert f'UUID="{gpu.uuid}"' in text or f'uuid="{gpu.uuid}"' in text
        assert status["inventory"]["serials"] == last.inventory.serials
        # readings describe the same GPUs (records are emitted on change, so compare ids)
        assert {r["uuid"] for r in readings(out)} == {g.uuid for g in last.inventory.gpus}


async def test_gauges_are_current_although_nobody_probes() -> None:
    s = settings(simulate="gb200x4")
    async with running_agent(Agent(s, exporters=[StdoutExporter(io.BytesIO())])) as agent:
        registry = agent.metrics.registry

        def ready() -> bool:
            ok = registry.get_sample_value("gpuid_health_check_success") == 1
            state = registry.get_sample_value(
                "gpuid_exporter_state", {"exporter": "stdout", "state": "ok"}
            )
            return ok and state == 1

        await eventually(ready)  # no HTTP request was made to the agent


async def test_simulation_sets_itself_up_behind_one_call() -> None:
    simulated = node_environment(settings(simulate="h100x8"))
    assert isinstance(simulated, SimulatedNode)
    assert simulated.machine() == ("sim-node-a", "simulated")
    await simulated.start()
    try:
        client = PodResourcesClient(simulated.pod_resources_socket, timeout=5)
        try:
            snapshot = await client.list()
        finally:
            await client.close()
        assert snapshot.pod_resources, "the simulated kubelet serves pods for the simulated GPUs"
    finally:
        await simulated.stop()
    host = node_environment(settings(pod_resources_socket="/nonexistent/kubelet.sock"))
    assert isinstance(host, HostNode)
    assert host.pod_resources_socket == "/nonexistent/kubelet.sock"
    assert host.machine() == ("node-a", "node_name")  # no DMI or machine-id file configured
