"""Per-process shares end to end: the C fake libnvidia-ml lists processes, a fake host /proc
maps them to pods, the real kube-apiserver names the containers (pods read with the agent's
pod-bound token under the chart's RBAC), the kubelet's own pod-resources server (Go,
`real_kubelet`) says who holds which GPU, and the agent's /gpu/metrics and /status are read
over HTTP.

The stand-in API server (`tests/fakekube`) stays for one hostile body the real server refuses
to store: a container status whose containerID is a number
(`test_a_malformed_container_status_is_skipped`)."""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.kube.client import create_kube_client
from gpuid_agent.sources.kube.pods import PodCache
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, serves, settings
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.fakekubelet import pod
from tests.fakenvml import FakeProcess, FakeProcessUtil
from tests.fakenvml.fixtures import FakeNvml
from tests.fakeproc import FakeProc, cgroupfs_path, systemd_path, v1, v2
from tests.realkube import objects as real
from tests.realkube.chart import AgentIdentity
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.waiting import eventually

GIB = 1024**3
CID_TRAIN, CID_SERVE, CID_ROGUE = "a1" * 32, "b2" * 32, "c3" * 32


@dataclass
class Api:
    """The real API server as the agent of `node` sees it, and a namespace of this test's own
    for the workload pods (pod names are asserted, so they repeat across tests)."""

    admin: Client
    node: str
    namespace: str

    def pod(self, name: str, container: str, cid: str, *, init: str | None = None) -> str:
        """A running pod on the node whose container has the runtime id `cid`; its UID."""
        obj = real.pod(self.namespace, name, self.node, containers=(container,))
        if init is not None:
            obj["spec"]["initContainers"] = [{"name": init, "image": "registry.invalid/init:1"}]
        created = real.create_pod(self.admin, obj)
        self.container_ids(name, {container: f"containerd://{cid}"})
        return str(created["metadata"]["uid"])

    def container_ids(
        self, name: str, containers: dict[str, str], init: dict[str, str] | None = None
    ) -> None:
        """The container statuses the kubelet reports: `containers` and `init` name → id."""

        def statuses(ids: dict[str, str], running: bool) -> list[dict[str, Any]]:
            return [
                {
                    "name": c,
                    "containerID": cid,
                    "ready": running,
                    "restartCount": 1,
                    "image": "registry.invalid/workload:1",
                    "imageID": "",
                    "state": {"running": {}} if running else {"terminated": {"exitCode": 0}},
                }
                for c, cid in ids.items()
            ]

        status: dict[str, Any] = {"containerStatuses": statuses(containers, True)}
        if init is not None:
            status["initContainerStatuses"] = statuses(init, False)
        path = f"/api/v1/namespaces/{self.namespace}/pods/{name}/status"
        self.admin.merge_patch(path, {"status": status})


@pytest.fixture
def api(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, monkeypatch: pytest.MonkeyPatch
) -> Api:
    """KUBECONFIG holds the agent's pod-bound token."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    return Api(kube_cluster.admin, agent_node.node, real.unique("ml"))


def scenario(api: Api, proc: FakeProc) -> tuple[fakenvml.FakeNvmlConfig, list[Any]]:
    """GPU 0 time-sliced by train and serve, with a host process and a pod that does not hold
    it; GPU 1 held and idle; GPU 2 busy and held by nobody; the rest free."""
    uids = {n: api.pod(n, c, i) for n, c, i in [
        ("train", "trainer", CID_TRAIN), ("serve", "server", CID_SERVE), ("rogue", "app", CID_ROGUE)
    ]}  # fmt: skip
    proc.add(100, v2(systemd_path(uids["train"], CID_TRAIN)))
    proc.add(101, v1(cgroupfs_path(uids["train"], CID_TRAIN, "guaranteed")))
    proc.add(200, v2(cgroupfs_path(uids["serve"], CID_SERVE, "besteffort")))
    proc.add(300, v2("/system.slice/nvidia-persistenced.service"))
    proc.add(400, v2(systemd_path(uids["rogue"], CID_ROGUE)))
    config = fakenvml.h100x8()
    for gpu in config.gpus:
        gpu.util_gpu, gpu.mem_used = 0, 300 * 1024**2
        gpu.mem_free = (gpu.mem_total or 0) - gpu.mem_used
    g0, g2 = config.gpus[0], config.gpus[2]
    g0.util_gpu, g0.mem_used = 90, 40 * GIB
    g0.processes = [FakeProcess(100, 20 * GIB), FakeProcess(101, 2 * GIB)]
    g0.mps_processes = [FakeProcess(200, 10 * GIB), FakeProcess(300, GIB)]
    g0.process_util = [FakeProcessUtil(100, 50), FakeProcessUtil(200, 30), FakeProcessUtil(300, 5)]
    g2.util_gpu, g2.mem_used = 70, 6 * GIB
    g2.processes = [FakeProcess(400, 5 * GIB)]
    g2.process_util = [FakeProcessUtil(400, 70)]
    uuids = [g.uuid or "" for g in config.gpus]
    ns = api.namespace
    pods = [
        pod(ns, "train", "trainer", "nvidia.com/gpu", f"{uuids[0]}::0"),
        pod(ns, "serve", "server", "nvidia.com/gpu", f"{uuids[0]}::1"),
        pod(ns, "notebook", "jupyter", "nvidia.com/gpu", uuids[1]),
    ]
    return config, pods


async def scrape(agent: Agent, path: str) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as resp,
    ):
        assert resp.status == 200
        return await resp.text()


def samples(text: str, name: str) -> list[Any]:
    return [s for f in text_string_to_metric_families(text) if f.name == name for s in f.samples]


async def test_time_sliced_gpu_shares_add_up_and_unattributed_is_explicit(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, api: Api, tmp_path: Path
) -> None:
    proc = FakeProc(tmp_path / "proc")
    config, real_kubelet.pods = scenario(api, proc)
    real_kubelet.publish()
    fake_nvml.apply(config)
    uuids = [g.uuid for g in config.gpus]
    s = settings(
        node_name=api.node,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        process_attribution=True,
        host_proc=str(proc.root),
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b'pod="serve"'))
        text = await scrape(agent, "/gpu/metrics")
        holders = {
            (
                x.labels["uuid"],
                x.labels["pod"],
                x.labels["container"],
                x.labels["allocated"],
            ): x.value
            for x in samples(text, "gpuid_gpu_holder_memory_used_bytes")
        }
        assert holders == {
            (uuids[0], "train", "trainer", "true"): 22 * GIB,  # two processes, v1 and v2
            (uuids[0], "serve", "server", "true"): 10 * GIB,
            (uuids[2], "rogue", "app", "false"): 5 * GIB,  # busy on a GPU it does not hold
        }
        unattributed = {
            (x.labels["uuid"], x.labels["reason"]): x.value
            for x in samples(text, "gpuid_gpu_unattributed_memory_used_bytes")
        }
        assert unattributed[(uuids[0], "host_process")] == GIB
        assert unattributed[(uuids[0], "unaccounted")] == 40 * GIB - 33 * GIB
        # every GPU: its parts add up to its own figure
        used = {x.labels["uuid"]: x.value for x in samples(text, "gpuid_gpu_memory_used_bytes")}
        for u in uuids:
            parts = sum(v for k, v in holders.items() if k[0] == u)
            parts += sum(v for k, v in unattributed.items() if k[0] == u)
            assert parts == pytest.approx(used[u]), u
        sm = {
            (x.labels["uuid"], x.labels.get("pod") or x.labels.get("reason")): x.value
            for name in ("gpuid_gpu_holder_sm_utilization_ratio", "gpuid_gpu_unattributed_sm_utilization_ratio")
            for x in samples(text, name)
        }  # fmt: skip
        assert sm[(uuids[0], "train")] == 0.5 and sm[(uuids[0], "serve")] == 0.3
        assert sm[(uuids[0], "unaccounted")] == pytest.approx(0.05)
        states = {
            x.labels["uuid"]: x.labels["state"]
            for x in samples(text, "gpuid_gpu_allocation_state")
            if x.value == 1
        }
        assert (
            states
            == {
                uuids[0]: "held_busy",
                uuids[1]: "held_idle",  # idle but allocated
                uuids[2]: "unowned_busy",  # busy but unowned
                **{u: "free" for u in uuids[3:]},  # idle GPUs never vanish
            }
        )
        status = await _json(agent, "/status")
        assert status["processes"]["state"] == "current"
        assert status["processes"]["unattributed"] == {"host_process": 1}
        usage = {row["uuid"]: row for row in status["usage"]}
        assert usage[uuids[1]]["state"] == "held_idle"
        assert usage[uuids[1]]["holders"] == [f"{api.namespace}/notebook/jupyter"]
        assert usage[uuids[2]]["state"] == "unowned_busy"

        proc.remove(200)  # serve's process exited; NVML still lists it this pass
        await eventually(lambda: serves(agent, b'reason="pid_gone"'))
        text = await scrape(agent, "/gpu/metrics")
        gone = samples(text, "gpuid_gpu_unattributed_processes")
        assert {(x.labels["reason"], x.value) for x in gone if x.labels["uuid"] == uuids[0]} >= {
            ("pid_gone", 1),
            ("host_process", 1),
        }
        assert 'pod="serve"' not in text.split("gpuid_gpu_holder_memory_used_bytes")[1]


async def _json(agent: Agent, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as resp,
    ):
        return await resp.json()


async def test_off_makes_no_process_call_and_reads_no_proc(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, tmp_path: Path
) -> None:
    config = fakenvml.h100x8()
    config.gpus[0].processes = [FakeProcess(100, GIB)]
    config.gpus[0].util_gpu = 0
    # a process call would hang, and reading this /proc would block on the FIFO forever
    config.gpus[0].blocks = {"processes": 60.0, "process_util": 60.0}
    fake_nvml.apply(config)
    root = tmp_path / "proc"
    (root / "100").mkdir(parents=True)
    os.mkfifo(root / "100" / "cgroup")
    real_kubelet.pods = [pod("ml", "idle", "c", "nvidia.com/gpu", config.gpus[0].uuid or "")]
    real_kubelet.publish()
    s = settings(
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        host_proc=str(root),
        stall_timeout=2.0,
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b'pod="idle"'))
        seq = agent.bus.latest.seq if agent.bus.latest else 0
        await eventually(lambda: agent.bus.latest and agent.bus.latest.seq > seq + 20)
        assert agent.collector.stalled() is None
        text = await scrape(agent, "/gpu/metrics")
        assert "gpuid_gpu_holder_" not in text and "gpuid_gpu_unattributed_" not in text
        held = [x for x in samples(text, "gpuid_gpu_allocation_state") if x.value == 1]
        assert {x.labels["state"] for x in held if x.labels["uuid"] == config.gpus[0].uuid} == {
            "held_idle"
        }
        assert (await _json(agent, "/status"))["processes"]["state"] == "off"


async def test_mig_devices_get_their_own_shares_and_states(
    fake_nvml: FakeNvml, real_kubelet: KubeletServer, api: Api, tmp_path: Path
) -> None:
    proc = FakeProc(tmp_path / "proc")
    uid = api.pod("research", "worker", CID_TRAIN)
    proc.add(10, v2(systemd_path(uid, CID_TRAIN)))
    proc.add(20, v2("/user.slice/user-1000.slice/session-4.scope"))
    config = fakenvml.mig_h100()
    mig = config.gpus[0].mig
    config.gpus[0].processes = [
        FakeProcess(10, 12 * 1024**2, mig[0].gi_id, mig[0].ci_id),
        FakeProcess(20, 4 * 1024**2, mig[1].gi_id, mig[1].ci_id),
    ]
    fake_nvml.apply(config)
    real_kubelet.pods = [
        pod(api.namespace, "research", "worker", "nvidia.com/mig-3g.40gb", mig[0].uuid or "")
    ]
    real_kubelet.publish()
    s = settings(
        node_name=api.node,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        process_attribution=True,
        host_proc=str(proc.root),
    )
    agent = Agent(
        s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(io.BytesIO())]
    )
    async with running_agent(agent):
        await eventually(lambda: serves(agent, b'allocated="true"'))
        text = await scrape(agent, "/gpu/metrics")
    states = {
        x.labels["gpu_instance_id"]: x.labels["state"]
        for x in samples(text, "gpuid_gpu_allocation_state")
        if x.value == 1
    }
    gi0, gi1 = str(mig[0].gi_id), str(mig[1].gi_id)
    assert states == {gi0: "held_busy", gi1: "unowned_busy"}  # the parent GPU is not a device
    (held,) = samples(text, "gpuid_gpu_holder_memory_used_bytes")
    assert (held.labels["gpu_instance_id"], held.labels["pod"], held.value) == (
        gi0,
        "research",
        12 * 1024**2,
    )
    rest = {
        (x.labels["gpu_instance_id"], x.labels["reason"]): x.value
        for x in samples(text, "gpuid_gpu_unattributed_memory_used_bytes")
    }
    assert rest[(gi1, "host_process")] == 4 * 1024**2
    # each MIG device's parts add up to its own memory used (13 MiB and 6 MiB in the fake)
    assert rest[(gi0, "unaccounted")] == 1024**2 and rest[(gi1, "unaccounted")] == 2 * 1024**2
    assert not any(k[0] == "" for k in rest)  # nothing left over on the parent GPU


@asynccontextmanager
async def watching(node: str, environ: dict[str, str] | None = None) -> AsyncIterator[PodCache]:
    """The agent's pod cache of `node`, listed and watching through its own client."""
    client = await create_kube_client("auto", environ=environ)
    assert client is not None
    cache = PodCache(node)
    assert cache.open(client)
    task = asyncio.create_task(cache.run())
    try:
        await eventually(lambda: cache.ready)
        yield cache
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_pod_cache_follows_container_restarts_by_uid(api: Api) -> None:
    """A restarted container gets a new id: the watch's MODIFIED event must reach `by_uid`,
    and a deleted pod stays findable by UID while its tombstone lasts."""
    ns = api.namespace
    uid = api.pod("train", "trainer", CID_TRAIN, init="init")
    async with watching(api.node) as cache:
        meta = cache.by_uid(uid)
        assert meta is not None and dict(meta.containers) == {CID_TRAIN: "trainer"}
        api.container_ids(
            "train",
            {"trainer": f"cri-o://{CID_SERVE}"},
            init={"init": f"containerd://{CID_ROGUE.upper()}"},
        )
        await eventually(lambda: CID_SERVE in (cache.by_uid(uid) or meta).containers)
        assert dict(cache.by_uid(uid).containers) == {CID_SERVE: "trainer", CID_ROGUE: "init"}  # type: ignore[union-attr]
        real.remove_pod(api.admin, ns, "train")
        await eventually(lambda: (ns, "train") not in cache._pods)
        assert cache.lookup(ns, "train") is not None
        assert cache.by_uid(uid) is not None  # tombstoned: its processes still attributed
        assert cache.by_uid("") is None and cache.by_uid("nope") is None


async def test_a_malformed_container_status_is_skipped(tmp_path: Path) -> None:
    """A containerID that is not a string (the real server refuses to store one) is skipped;
    the other statuses of the same event are kept."""
    async with FakeKube(token="t0ken") as kube:
        kubeconfig = write_kubeconfig(tmp_path / "kc", kube.url, token="t0ken")
        obj = objects.pod("train", namespace="ml", node_name="node-a", containers=("trainer",))
        uid = str(kube.create(obj)["metadata"]["uid"])
        async with watching("node-a", {"KUBECONFIG": str(kubeconfig)}) as cache:
            stored = kube.get("Pod", "train", "ml")
            assert stored is not None
            stored["status"]["containerStatuses"] = [
                {"name": "trainer", "containerID": f"cri-o://{CID_SERVE}"},
                {"name": "bad", "containerID": 7},
            ]
            kube.update(stored)
            await eventually(lambda: (m := cache.by_uid(uid)) and CID_SERVE in m.containers)
            assert dict(cache.by_uid(uid).containers) == {CID_SERVE: "trainer"}  # type: ignore[union-attr]
