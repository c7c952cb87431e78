"""`--simulate dra`: the in-process kubelet serves DRA claims and the simulated node's driver
offers its ResourceSlice, so whole GPUs, a shared claim and MIG devices are attributed."""

from __future__ import annotations

import io

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.dra import dra_pods, dra_slices
from gpuid_agent.simulate.profiles import dra_h100
from gpuid_agent.sources.kubelet import parse_dra_device
from tests.conftest import running_agent, serves, settings
from tests.fakekube.resources import validate_resource_slice
from tests.waiting import eventually


async def test_simulated_dra_node_attributes_claims() -> None:
    out = io.BytesIO()
    agent = Agent(
        settings(simulate="dra", pod_resources_interval=0.05), exporters=[StdoutExporter(out)]
    )
    async with running_agent(agent), aiohttp.ClientSession() as http:
        await eventually(lambda: serves(agent, b"gpuid_gpu_claim_info{"))
        base = f"http://127.0.0.1:{agent.bound_port}"
        async with http.get(f"{base}/gpu/metrics") as resp:
            text = await resp.text()
        async with http.get(f"{base}/status") as resp:
            status = orjson.loads(await resp.read())
        await eventually(lambda: out.getvalue().count(b'"claim_source":"dra"') >= 6)
    claims = {
        (s.labels["pod"], s.labels["gpu"], s.labels["gpu_instance_profile"], s.labels["source"])
        for f in text_string_to_metric_families(text)
        if f.name == "gpuid_gpu_claim_info"
        for s in f.samples
    }
    assert claims == {
        ("mig-job-0", "0", "3g.40gb", "dra"),
        ("mig-job-1", "0", "2g.20gb", "dra"),
        ("llm-serve-0", "1", "", "dra"),
        ("llm-serve-1", "1", "", "dra"),  # one claim, two pods
        ("train-0", "2", "", "dra"),
        ("train-0", "3", "", "dra"),
    }
    dra = status["attribution"]["dra"]
    assert dra["resource_slices"]["devices"] == 6 and dra["fallback"] == 0
    assert status["attribution"]["unmapped"] == []  # the NIC driver's claim is ignored


def test_simulated_devices_are_named_as_nvidias_driver_names_them() -> None:
    """gpu-<minor>, and gpu-<minor>-mig-<profileID>-<placement start>-<size> with H100 profile
    ids and the placements NVML gives: DNS labels, as a real API server requires."""
    gpus = dra_h100("node-a")
    (published,) = dra_slices(gpus, "node-a")
    names = [d["name"] for d in published["spec"]["devices"]]
    assert names == [
        "gpu-0-mig-9-0-4",  # 3g.40gb at memory slice 0
        "gpu-0-mig-14-4-2",  # 2g.20gb at 4
        "gpu-0-mig-19-6-1",  # 1g.10gb at 6
        "gpu-1",
        "gpu-2",
        "gpu-3",
    ]
    assert validate_resource_slice(published) == []
    assert [parse_dra_device(n).minor for n in names] == [0, 0, 0, 1, 2, 3]
    claimed = {
        d.device
        for p in dra_pods(gpus, "node-a")
        for c in p.containers
        for claim in c.claims
        for d in claim.devices
        if d.driver == "gpu.nvidia.com"
    }
    assert claimed <= set(names)
