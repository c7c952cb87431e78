"""DRA end to end: fake libnvidia-ml (real pynvml), the kubelet's own pod-resources server
(Go, `real_kubelet`) reporting `dynamic_resources`, the real kube-apiserver serving this node's
ResourceSlice in resource.k8s.io/v1 (read with the agent's pod-bound token under the chart's
RBAC), and the agent; asserted on /gpu/metrics (both namings), /status and the allocation
records. A MIG device the DRA driver creates while the agent runs is attributed without a
restart; without the API the full GPUs are attributed through the fallback and say so.
Nothing here is a fault: no stand-in."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.pods import ClaimDevice, KubeletClaim, KubeletPod, claim_pod
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, serves, settings
from tests.fakekube import objects
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.chart import AgentIdentity
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually

NODE = "node-a"
GPU = "gpu.nvidia.com"
BIG_MIG = "gpu-0-mig-9-0-4"
MIG_NAME = "gpu-0-mig-19-6-1"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def nvml_config() -> fakenvml.FakeNvmlConfig:
    """GPU 0 in MIG mode (3g.40gb and 1g.10gb instances), GPUs 1 and 2 whole."""
    mig = fakenvml.mig_h100()
    whole = fakenvml.h100x8().gpus[1:3]
    return fakenvml.FakeNvmlConfig(gpus=[mig.gpus[0], *whole])


def claim(node: str, namespace: str, name: str, *devices: str) -> KubeletClaim:
    """A claim allocated from `node`'s pool (NVIDIA's driver names the pool after the node)."""
    return KubeletClaim(namespace, name, tuple(ClaimDevice(GPU, node, d) for d in devices))


def kubelet_pods(node: str = NODE, *, with_new_mig: bool = False) -> list[KubeletPod]:
    shared = claim(node, "ml", "shared-gpu", "gpu-2")
    nic = KubeletClaim("net", "nic", (ClaimDevice("dra.net", node, "eth1"),))
    pods = [
        claim_pod("ml", "train-0", "trainer", claim(node, "ml", "train-gpu", "gpu-1")),
        claim_pod("ml", "serve-a", "server", shared),
        claim_pod("ml", "serve-b", "server", shared),
        claim_pod("research", "big", "w", claim(node, "research", "big-mig", BIG_MIG)),
        claim_pod("net", "rdma", "c", nic),
    ]
    if with_new_mig:
        pods.append(
            claim_pod("research", "small", "w", claim(node, "research", "small-mig", MIG_NAME))
        )
    return pods


def node_slice(
    config: fakenvml.FakeNvmlConfig, node: str = NODE, *, version: str = "v1"
) -> dict[str, Any]:
    gpu0 = config.gpus[0]
    devices = [
        objects.gpu_device(f"gpu-{i}", g.uuid or "", version=version)
        for i, g in enumerate(config.gpus)
    ]
    devices.append(
        objects.gpu_device(BIG_MIG, gpu0.mig[0].uuid or "", parent_uuid=gpu0.uuid, version=version)
    )
    return objects.resource_slice(f"{node}-gpu.nvidia.com-abcde", node, devices, version=version)


@dataclass
class DraNode:
    """The agent's node on the real API server (KUBECONFIG holds its pod-bound token) and an
    admin client publishing ResourceSlices as the DRA driver does."""

    admin: Client
    node: str

    def publish(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.admin.create(SLICES, obj)  # type: ignore[no-any-return]

    def republish(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace a published slice (its resourceVersion read back with it): watch MODIFIED."""
        path = f"{SLICES}/{obj['metadata']['name']}"
        return self.admin.request("PUT", path, obj)  # type: ignore[no-any-return]


@pytest.fixture
def dra_node(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> DraNode:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    return DraNode(kube_cluster.admin, agent_node.node)


def make_agent(fake: FakeNvml, kubelet: KubeletServer, out: io.BytesIO, **overrides: Any) -> Agent:
    s = settings(
        pod_resources_socket=kubelet.socket_path,
        pod_resources_interval=0.05,
        **overrides,
    )
    return Agent(s, nvml_api=PynvmlApi(str(fake.lib_path)), exporters=[StdoutExporter(out)])


async def get(agent: Agent, path: str) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as resp,
    ):
        assert resp.status == 200
        return await resp.text()


def samples(text: str, family: str) -> list[dict[str, str]]:
    return [
        dict(s.labels)
        for f in text_string_to_metric_families(text)
        if f.name == family
        for s in f.samples
    ]


def claim_rows(text: str) -> set[tuple[str, ...]]:
    return {  # a gpuid_* family: snake_case labels under either naming
        (s["pod"], s["gpu_instance_id"], s["claim_name"], s["dra_device"], s["source"])
        for s in samples(text, "gpuid_gpu_claim_info")
    }


@pytest.mark.parametrize("naming", ["prometheus", "dcgm"])
async def test_dra_through_resourceslices_with_a_mig_device_appearing(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, dra_node: DraNode, naming: str
) -> None:
    config = nvml_config()
    fake_nvml.apply(config)
    real_kubelet.pods = kubelet_pods(dra_node.node)
    real_kubelet.publish()
    out = io.BytesIO()
    created = dra_node.publish(node_slice(config, dra_node.node))
    agent = make_agent(
        fake_nvml,
        real_kubelet,
        out,
        node_name=dra_node.node,
        kube_api="auto",
        metrics_naming=naming,
    )
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b'claim_name="big-mig"'), within=20)
        text = await get(agent, "/gpu/metrics")
        gpu0, gpu1, gpu2 = (g.uuid for g in config.gpus)
        assert claim_rows(text) == {
            ("train-0", "", "train-gpu", "gpu-1", "dra"),
            ("serve-a", "", "shared-gpu", "gpu-2", "dra"),
            ("serve-b", "", "shared-gpu", "gpu-2", "dra"),
            ("big", "2", "big-mig", BIG_MIG, "dra"),
        }
        # the NIC driver's claim is not a GPU: nowhere
        assert "rdma" not in text
        # gpuid_* families keep snake_case labels under either naming
        held = {
            (s["uuid"], s["gpu_instance_id"], s["pod"])
            for s in samples(text, "gpuid_gpu_allocation_info")
        }
        assert held == {
            (gpu1, "", "train-0"),
            (gpu2, "", "serve-a"),
            (gpu2, "", "serve-b"),
            (gpu0, "2", "big"),
        }
        if naming == "dcgm":  # dcgm-exporter's layout: holders on the telemetry itself
            temps = {
                (s["UUID"], s["pod"], s["namespace"]) for s in samples(text, "DCGM_FI_DEV_GPU_TEMP")
            }
            assert {(gpu2, "serve-a", "ml"), (gpu2, "serve-b", "ml")} <= temps
        status = orjson.loads(await get(agent, "/status"))
        dra = status["attribution"]["dra"]
        assert dra["resource_slices"]["version"] == "resource.k8s.io/v1"
        assert (dra["allocations"], dra["fallback"]) == (5 - 1, 0)
        assert {(c["pod"], c["claim"], c["source"]) for c in dra["claims"]} == {
            ("ml/train-0", "ml/train-gpu", "dra"),
            ("ml/serve-a", "ml/shared-gpu", "dra"),
            ("ml/serve-b", "ml/shared-gpu", "dra"),
            ("research/big", "research/big-mig", "dra"),
        }

        # The DRA driver creates a 1g.10gb device on GPU 0 for a new claim: NVML shows it,
        # the slice is republished (watch MODIFIED), the kubelet reports the claim.
        new_uuid = "MIG-cccccccc-1111-4222-8333-444444444444"
        config.gpus[0].mig.append(
            fakenvml.FakeMig(
                uuid=new_uuid,
                name=f"{fakenvml.H100_NAME} MIG 1g.10gb",
                gi_id=13,
                ci_id=0,
                mem_total=9856 * 1024 * 1024,
                mem_used=1024 * 1024,
            )
        )
        fake_nvml.apply(config)
        real_kubelet.pods = kubelet_pods(dra_node.node, with_new_mig=True)
        real_kubelet.publish()
        created["spec"]["devices"].append(objects.gpu_device(MIG_NAME, new_uuid, parent_uuid=gpu0))
        dra_node.republish(created)
        await eventually(lambda: serves(agent, b'claim_name="small-mig"'), within=20)
        text = await get(agent, "/gpu/metrics")
        assert ("small", "13", "small-mig", MIG_NAME, "dra") in claim_rows(text)
        await eventually(lambda: out.getvalue().count(b'"claim_name":"small-mig"') >= 1)
    records = [orjson.loads(line) for line in out.getvalue().splitlines() if line.strip()]
    starts = {
        (r["pod"], r["claim_name"], r["mig_uuid"])
        for r in records
        if r.get("kind") == "allocation" and r.get("claim_name")
    }
    assert ("small", "small-mig", new_uuid) in starts
    assert ("serve-b", "shared-gpu", None) in starts


async def test_without_the_api_full_gpus_are_attributed_as_fallback(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer
) -> None:
    config = nvml_config()
    fake_nvml.apply(config)
    real_kubelet.pods = kubelet_pods()
    real_kubelet.publish()
    out = io.BytesIO()
    agent = make_agent(fake_nvml, real_kubelet, out)  # KUBE_API=off
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b"gpuid_gpu_claim_info{"))
        text = await get(agent, "/gpu/metrics")
        assert claim_rows(text) == {
            ("train-0", "", "train-gpu", "gpu-1", "dra-fallback"),
            ("serve-a", "", "shared-gpu", "gpu-2", "dra-fallback"),
            ("serve-b", "", "shared-gpu", "gpu-2", "dra-fallback"),
        }
        status = orjson.loads(await get(agent, "/status"))
        dra = status["attribution"]["dra"]
        assert not dra["resource_slices"]["available"] and dra["fallback"] == 3
        (unmapped,) = status["attribution"]["unmapped"]
        assert (unmapped["pod"], unmapped["reason"], unmapped["claim"]) == (
            "research/big",
            "dra_mig_unresolved",
            "research/big-mig",
        )
        await eventually(lambda: out.getvalue().count(b'"claim_source":"dra-fallback"') >= 3)
