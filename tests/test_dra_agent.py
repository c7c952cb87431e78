"""DRA end to end: fake libnvidia-ml (real pynvml) + a real grpc.aio kubelet serving
`dynamic_resources` + the fake Kubernetes API serving ResourceSlices + the agent; asserted on
/gpu/metrics (both namings), /status and the allocation records. A MIG device the DRA driver
creates while the agent runs is attributed without a restart; without the API the full GPUs
are attributed through the fallback and say so."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.fakekubelet import ClaimDevice, FakeKubelet, KubeletClaim, claim_pod
from tests.fakenvml.fixtures import FakeNvml
from tests.waiting import eventually

NODE = "node-a"
GPU = "gpu.nvidia.com"
MIG_NAME = "gpu-0-mig-19-6-1"


def nvml_config() -> fakenvml.FakeNvmlConfig:
    """GPU 0 in MIG mode (3g.40gb and 1g.10gb instances), GPUs 1 and 2 whole."""
    mig = fakenvml.mig_h100()
    whole = fakenvml.h100x8().gpus[1:3]
    return fakenvml.FakeNvmlConfig(gpus=[mig.gpus[0], *whole])


def claim(namespace: str, name: str, *devices: str) -> KubeletClaim:
    return KubeletClaim(namespace, name, tuple(ClaimDevice(GPU, NODE, d) for d in devices))


def kubelet_pods(with_new_mig: bool = False) -> list[Any]:
    shared = claim("ml", "shared-gpu", "gpu-2")
    pods = [
        claim_pod("ml", "train-0", "trainer", claim("ml", "train-gpu", "gpu-1")),
        claim_pod("ml", "serve-a", "server", shared),
        claim_pod("ml", "serve-b", "server", shared),
        claim_pod("research", "big", "w", claim("research", "big-mig", "gpu-0-mig-9-0-4")),
        claim_pod(
            "net", "rdma", "c", KubeletClaim("net", "nic", (ClaimDevice("dra.net", NODE, "eth1"),))
        ),
    ]
    if with_new_mig:
        pods.append(claim_pod("research", "small", "w", claim("research", "small-mig", MIG_NAME)))
    return pods


def node_slice(config: fakenvml.FakeNvmlConfig, *, version: str = "v1") -> dict[str, Any]:
    gpu0 = config.gpus[0]
    devices = [
        objects.gpu_device(f"gpu-{i}", g.uuid or "", version=version)
        for i, g in enumerate(config.gpus)
    ]
    devices.append(
        objects.gpu_device(
            "gpu-0-mig-9-0-4", gpu0.mig[0].uuid or "", parent_uuid=gpu0.uuid, version=version
        )
    )
    return objects.resource_slice(f"{NODE}-gpu.nvidia.com-abcde", NODE, devices, version=version)


def make_agent(fake: FakeNvml, kubelet: FakeKubelet, out: io.BytesIO, **overrides: Any) -> Agent:
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
    fake_nvml: FakeNvml, kubelet: FakeKubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    naming: str,
) -> None:  # fmt: skip
    config = nvml_config()
    fake_nvml.apply(config)
    kubelet.pods = kubelet_pods()
    out = io.BytesIO()
    async with FakeKube(resource_versions=("v1",)) as kube:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", kube.url)))
        created = kube.create(node_slice(config))
        agent = make_agent(fake_nvml, kubelet, out, kube_api="auto", metrics_naming=naming)
        async with running_agent(agent):
            await eventually(
                lambda: b'claim_name="big-mig"' in agent.renderer.current().text, within=20
            )
            text = await get(agent, "/gpu/metrics")
            gpu0, gpu1, gpu2 = (g.uuid for g in config.gpus)
            assert claim_rows(text) == {
                ("train-0", "", "train-gpu", "gpu-1", "dra"),
                ("serve-a", "", "shared-gpu", "gpu-2", "dra"),
                ("serve-b", "", "shared-gpu", "gpu-2", "dra"),
                ("big", "2", "big-mig", "gpu-0-mig-9-0-4", "dra"),
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
                    (s["UUID"], s["pod"], s["namespace"])
                    for s in samples(text, "DCGM_FI_DEV_GPU_TEMP")
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
            kubelet.pods = kubelet_pods(with_new_mig=True)
            created["spec"]["devices"].append(
                objects.gpu_device(MIG_NAME, new_uuid, parent_uuid=gpu0)
            )
            kube.update(created)
            await eventually(
                lambda: b'claim_name="small-mig"' in agent.renderer.current().text, within=20
            )
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
    fake_nvml: FakeNvml, kubelet: FakeKubelet
) -> None:
    config = nvml_config()
    fake_nvml.apply(config)
    kubelet.pods = kubelet_pods()
    out = io.BytesIO()
    agent = make_agent(fake_nvml, kubelet, out)  # KUBE_API=off
    async with running_agent(agent):
        await eventually(lambda: b"gpuid_gpu_claim_info{" in agent.renderer.current().text)
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
