"""Workload enrichment against the fake Kubernetes API: node-scoped list+watch, owner walking,
410 resumption, RBAC refusals, and the agent end to end."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.sources.kube.pods import PodCache
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, settings
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.fakekubelet import FakeKubelet, pod
from tests.fakenvml.fixtures import FakeNvml
from tests.waiting import eventually

NODE = "node-a"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(token="t0ken") as server:
        yield server


@pytest.fixture
def kubeconfig(kube: FakeKube, tmp_path: Path) -> Path:
    return write_kubeconfig(tmp_path / "kubeconfig", kube.url, token="t0ken")


@pytest.fixture
async def client(kubeconfig: Path) -> AsyncIterator[KubeClient]:
    """The API client the agent would share with its pod cache."""
    found = await create_kube_client("auto", environ={"KUBECONFIG": str(kubeconfig)})
    assert found is not None
    yield found
    await found.close()


def workloads(kube: FakeKube) -> dict[str, dict[str, Any]]:
    """One pod per kind of owner on NODE, one pod elsewhere; returns the pods by name."""
    deploy = kube.create(objects.deployment("web"))
    rs = kube.create(objects.replicaset("web-7d4b9c8f6d", owners=[objects.owner(deploy)]))
    cron = kube.create(objects.cronjob("nightly"))
    job = kube.create(objects.job("nightly-28901234", owners=[objects.owner(cron)]))
    bare_job = kube.create(objects.job("once"))
    sts = kube.create(objects.statefulset("db"))
    ds = kube.create(objects.daemonset("agent"))
    web_labels = {"app": "web", "pod-template-hash": "7d4b9c8f6d", "team": "search"}
    specs = {
        "web-7d4b9c8f6d-abcde": dict(owners=[objects.owner(rs)], labels=web_labels),
        "web-7d4b9c8f6d-fghij": dict(owners=[objects.owner(rs)], labels=web_labels),
        "nightly-28901234-xyz": dict(owners=[objects.owner(job)]),
        "once-q8x7z": dict(owners=[objects.owner(bare_job)]),
        "db-0": dict(owners=[objects.owner(sts)], labels={"team": "storage"}),
        "agent-k2j4h": dict(owners=[objects.owner(ds)]),
        "loner": {},
    }
    pods = {
        name: kube.create(objects.pod(name, node_name=NODE, **spec))  # type: ignore[arg-type]
        for name, spec in specs.items()
    }
    kube.create(objects.pod("elsewhere", node_name="node-b", owners=[objects.owner(sts)]))
    return pods


def pod_requests(kube: FakeKube) -> int:
    """Requests about pods and their owners (other parts of the agent read the Node)."""
    owners = ("/pods", "/replicasets", "/jobs")
    return sum(1 for r in kube.requests if any(part in r.path for part in owners))


def cache_for(**kwargs: Any) -> PodCache:
    return PodCache(NODE, label_allowlist=["team", "absent"], **kwargs)


async def running(cache: PodCache, client: KubeClient) -> asyncio.Task[None]:
    assert cache.open(client)
    task = asyncio.create_task(cache.run())
    await eventually(lambda: cache.ready)
    return task


async def stop(cache: PodCache, task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_owner_walking_and_node_scope(kube: FakeKube, client: KubeClient) -> None:
    pods = workloads(kube)
    cache = cache_for()
    task = await running(cache, client)
    try:
        want = {
            "web-7d4b9c8f6d-abcde": ("Deployment", "web"),
            "web-7d4b9c8f6d-fghij": ("Deployment", "web"),
            "nightly-28901234-xyz": ("CronJob", "nightly"),
            "once-q8x7z": ("Job", "once"),
            "db-0": ("StatefulSet", "db"),
            "agent-k2j4h": ("DaemonSet", "agent"),
            "loner": ("", ""),
        }
        for name, (kind, owner) in want.items():
            meta = cache.lookup("default", name)
            assert meta is not None, name
            assert (meta.workload_kind, meta.workload_name) == (kind, owner), name
            assert meta.uid == pods[name]["metadata"]["uid"]
        assert cache.lookup("default", "elsewhere") is None  # another node's pod
        assert dict(cache.lookup("default", "db-0").labels) == {"team": "storage"}  # type: ignore[union-attr]
        lists = [r for r in kube.requests if r.verb == "list" and "/pods" in r.path]
        assert lists and all(r.query.get("fieldSelector") == f"spec.nodeName={NODE}" for r in lists)
        # two pods of one ReplicaSet: its owner is read once
        rs_reads = [r for r in kube.requests if r.verb == "get" and "/replicasets/" in r.path]
        assert len(rs_reads) == 1
        assert cache.board.is_ok("kube-pods")
    finally:
        await stop(cache, task)


async def test_watch_follows_changes_and_resumes_after_410(
    kube: FakeKube, client: KubeClient
) -> None:
    sts = kube.create(objects.statefulset("db"))
    kube.create(objects.pod("db-0", node_name=NODE, owners=[objects.owner(sts)]))
    cache = cache_for(watch_timeout=30)
    task = await running(cache, client)
    try:
        cache.changed.clear()
        kube.create(objects.pod("db-1", node_name=NODE, owners=[objects.owner(sts)]))
        await eventually(lambda: cache.lookup("default", "db-1"))
        assert cache.changed.is_set()
        kube.patch("Pod", "db-1", {"metadata": {"labels": {"team": "blue"}}}, namespace="default")
        await eventually(lambda: cache.lookup("default", "db-1").labels.get("team") == "blue")  # type: ignore[union-attr]

        kube.close_watches()  # the API server's watch timeout: resumed, not re-listed
        await eventually(lambda: kube.open_watches == 1)
        kube.create(objects.pod("db-2", node_name=NODE, owners=[objects.owner(sts)]))
        await eventually(lambda: cache.lookup("default", "db-2"))
        relists = cache.registry.get_sample_value("gpuid_pod_cache_relists_total")
        assert relists == 1

        old_uid = cache.lookup("default", "db-0").uid  # type: ignore[union-attr]
        kube.expire_watches()  # 410: history compacted, resuming is refused
        kube.delete("Pod", "db-0", namespace="default")
        kube.create(objects.pod("db-0", node_name=NODE, owners=[objects.owner(sts)]))
        await eventually(
            lambda: cache.registry.get_sample_value("gpuid_pod_cache_relists_total") == 2
        )
        await eventually(lambda: cache.lookup("default", "db-0").uid != old_uid)  # type: ignore[union-attr]

        kube.delete("Pod", "db-2", namespace="default")
        await eventually(lambda: cache.status()["pods"] == 2)
        # a deleted pod's metadata stays readable while its containers may still hold GPUs
        assert cache.lookup("default", "db-2") is not None
    finally:
        await stop(cache, task)


async def test_forbidden_list_leaves_the_kubelet_alone_in_charge(
    kube: FakeKube, client: KubeClient
) -> None:
    kube.inject(403, verb="list", times=1000, message="pods is forbidden")
    cache = cache_for(backoff_max=0.05)
    task = await running(cache, client)
    try:
        state = cache.board.get("kube-pods")
        # unavailable at first; a retry (full jitter: possibly at once) may say degraded
        assert state is not None and state.state in ("unavailable", "degraded")
        assert "forbidden" in (state.reason or "")
        assert cache.lookup("default", "anything") is None
        kube.clear_faults()  # RBAC fixed: the cache recovers on its own
        kube.create(objects.pod("late", node_name=NODE))
        await eventually(lambda: cache.lookup("default", "late"))
        assert cache.board.is_ok("kube-pods")
    finally:
        await stop(cache, task)


async def test_forbidden_replicaset_read_still_names_the_deployment(
    kube: FakeKube, client: KubeClient
) -> None:
    kube.inject(403, verb="get", path=re.compile(r".*/replicasets/.*"), times=100)
    pods = workloads(kube)
    cache = cache_for()
    task = await running(cache, client)
    try:
        meta = cache.lookup("default", "web-7d4b9c8f6d-abcde")
        assert meta is not None and (meta.workload_kind, meta.workload_name) == (
            "Deployment",
            "web",
        )
        assert meta.uid == pods["web-7d4b9c8f6d-abcde"]["metadata"]["uid"]
        forbidden = cache.registry.get_sample_value(
            "gpuid_owner_lookups_total", {"outcome": "forbidden"}
        )
        assert forbidden == 1  # remembered, not asked again for the second pod
    finally:
        await stop(cache, task)


async def test_no_configuration_means_ready_without_the_api() -> None:
    cache = PodCache(NODE)
    assert not cache.open(None)
    assert cache.ready and cache.lookup("default", "x") is None
    state = cache.board.get("kube-pods")
    assert state is not None and state.state == "unavailable"


async def test_agent_labels_and_trail_carry_the_workload(
    fake_nvml: FakeNvml,
    kubelet: FakeKubelet,
    kube: FakeKube,
    kubeconfig: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    pods = workloads(kube)
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    kubelet.pods = [
        pod("default", "web-7d4b9c8f6d-abcde", "main", "nvidia.com/gpu", config.gpus[0].uuid or ""),
        pod("default", "db-0", "main", "nvidia.com/gpu", config.gpus[1].uuid or ""),
        pod("default", "ghost", "main", "nvidia.com/gpu", config.gpus[2].uuid or ""),  # no API pod
    ]
    out = io.BytesIO()
    s = settings(
        kube_api="auto",
        pod_resources_socket=kubelet.socket_path,
        pod_resources_interval=0.05,
        pod_label_allowlist="team,app.kubernetes.io/name",
    )
    agent = Agent(s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(out)])
    async with running_agent(agent), aiohttp.ClientSession() as http:
        await eventually(lambda: out.getvalue().count(b'"kind":"allocation"') >= 3)
        url = f"http://127.0.0.1:{agent.bound_port}/gpu/metrics"
        await eventually(lambda: b'workload_name="web"' in agent.renderer.current().text)
        before = pod_requests(kube)
        for _ in range(10):
            async with http.get(url) as resp:
                text = await resp.text()
        assert pod_requests(kube) == before  # a scrape asks the API nothing
    info = {
        s.labels["pod"]: s.labels
        for f in text_string_to_metric_families(text)
        if f.name == "gpuid_gpu_allocation_info"
        for s in f.samples
    }
    web = info["web-7d4b9c8f6d-abcde"]
    assert (web["workload_kind"], web["workload_name"], web["label_team"]) == (
        "Deployment",
        "web",
        "search",
    )
    assert web["label_app_kubernetes_io_name"] == ""
    assert (info["db-0"]["workload_kind"], info["db-0"]["label_team"]) == ("StatefulSet", "storage")
    assert info["ghost"]["workload_kind"] == ""  # known to the kubelet only: still attributed
    starts = {
        r["pod"]: r
        for r in map(orjson.loads, out.getvalue().splitlines())
        if r["kind"] == "allocation"
    }
    assert starts["db-0"]["pod_uid"] == pods["db-0"]["metadata"]["uid"]
    assert (starts["db-0"]["workload_kind"], starts["db-0"]["workload_name"]) == (
        "StatefulSet",
        "db",
    )
    assert starts["ghost"]["pod_uid"] is None
