"""DRA end to end on the real parts: fake libnvidia-ml (real pynvml), the kubelet's own
pod-resources server reporting the claims' devices, and the real API server serving this node's
ResourceSlice and the ResourceClaims in resource.k8s.io/v1, read with the agent's pod-bound token
under the chart's RBAC."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.simulate.pods import ClaimDevice, KubeletClaim, claim_pod
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, serves, settings
from tests.fakekube import objects
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.chart import AgentIdentity
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.realkube.objects import ensure_namespace, unique
from tests.test_dra_agent import claim_rows, get
from tests.waiting import eventually

DRIVER = "gpu.nvidia.com"
# NVIDIA's name of a MIG device, gpu-<minor>-mig-<profileID>-<placement start>-<size>: the
# 3g.40gb instance (H100 profile id 9) at memory slice 0 of GPU 0
BIG_MIG = "gpu-0-mig-9-0-4"


def resource_claim(admin: Client, namespace: str, name: str, node: str, *devices: str) -> None:
    """A ResourceClaim as the scheduler leaves it: created by the user, allocated on `node`."""
    ensure_namespace(admin, namespace)
    requests = [
        {"name": f"r{i}", "exactly": {"deviceClassName": DRIVER}} for i in range(len(devices))
    ]
    admin.create(
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"devices": {"requests": requests}},
        },
    )
    results = [
        {"request": f"r{i}", "driver": DRIVER, "pool": node, "device": d}
        for i, d in enumerate(devices)
    ]
    admin.merge_patch(
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}/status",
        {"status": {"allocation": {"devices": {"results": results}}}},
    )


@pytest.fixture
def claims(kube_cluster: KubeCluster, agent_node: AgentIdentity) -> dict[str, KubeletClaim]:
    admin, node = kube_cluster.admin, agent_node.node
    ml, research = unique("ml"), unique("research")  # the session's cluster is shared
    wanted = {
        "train-gpu": (ml, "gpu-1"),
        "shared-gpu": (ml, "gpu-2"),
        "big-mig": (research, BIG_MIG),
    }
    found = {}
    for name, (namespace, device) in wanted.items():
        resource_claim(admin, namespace, name, node, device)
        found[name] = KubeletClaim(namespace, name, (ClaimDevice(DRIVER, node, device),))
    return found


def node_slice(config: fakenvml.FakeNvmlConfig, node: str) -> dict[str, Any]:
    devices = [objects.gpu_device(f"gpu-{i}", g.uuid or "") for i, g in enumerate(config.gpus)]
    gpu0 = config.gpus[0]
    devices.append(objects.gpu_device(BIG_MIG, gpu0.mig[0].uuid or "", parent_uuid=gpu0.uuid))
    return objects.resource_slice(f"{node}-{DRIVER}", node, devices)


async def test_claims_attributed_through_real_resourceslices(
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    claims: dict[str, KubeletClaim],
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    config = fakenvml.FakeNvmlConfig(
        gpus=[fakenvml.mig_h100().gpus[0], *fakenvml.h100x8().gpus[1:3]]
    )
    fake_nvml.apply(config)
    kube_cluster.admin.create(
        "/apis/resource.k8s.io/v1/resourceslices", node_slice(config, agent_node.node)
    )
    real_kubelet.pods = [
        claim_pod(claims["train-gpu"].namespace, "train-0", "trainer", claims["train-gpu"]),
        claim_pod(claims["shared-gpu"].namespace, "serve-a", "server", claims["shared-gpu"]),
        claim_pod(claims["shared-gpu"].namespace, "serve-b", "server", claims["shared-gpu"]),
        claim_pod(claims["big-mig"].namespace, "big", "w", claims["big-mig"]),
    ]
    real_kubelet.publish()
    s = settings(
        node_name=agent_node.node,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b'claim_name="big-mig"'), within=30)
        text = await get(agent, "/gpu/metrics")
        assert claim_rows(text) == {
            ("train-0", "", "train-gpu", "gpu-1", "dra"),
            ("serve-a", "", "shared-gpu", "gpu-2", "dra"),
            ("serve-b", "", "shared-gpu", "gpu-2", "dra"),
            ("big", "2", "big-mig", BIG_MIG, "dra"),
        }
        status = orjson.loads(await get(agent, "/status"))
        dra = status["attribution"]["dra"]
        assert dra["resource_slices"]["version"] == "resource.k8s.io/v1"
        assert (dra["allocations"], dra["fallback"]) == (4, 0)
