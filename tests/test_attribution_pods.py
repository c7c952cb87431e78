"""Workload enrichment: the pod cache's node-scoped list+watch, owner walking, RBAC refusals,
and the agent end to end.

On the real kube-apiserver, with the agent's pod-bound token under the chart's RBAC: every
kind of owner (StatefulSet, DaemonSet, a bare Job, none; one ReplicaSet read for its two pods;
the walk through a Deployment and a CronJob is also test_realkube_pods.py's), watch events
followed, refusals from releases whose role lacks a rule (pods; ReplicaSets), granted while the
cache runs, and the agent's metrics and allocation trail with the kubelet's own pod-resources
server (`real_kubelet`). Requests are counted by the agent's own
`gpuid_kube_api_requests_total`.

The stand-in API server (`tests/fakekube`) stays for watches ended and expired at a chosen
instant (`test_watch_resumes_after_the_server_ends_it_and_after_410`: a 410 on the real server
needs an etcd compaction, which test_realkube_pods.py makes)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.stdout import StdoutExporter
from gpuid_agent.runtime.metrics import AgentMetrics
from gpuid_agent.simulate.pods import pod as kubelet_pod
from gpuid_agent.sources.kube.client import KubeClient, create_kube_client, request_counter
from gpuid_agent.sources.kube.pods import PodCache
from gpuid_agent.sources.nvml.pynvml_api import PynvmlApi
from tests import fakenvml
from tests.conftest import running_agent, serves, settings
from tests.fakekube import FakeKube, objects, write_kubeconfig
from tests.fakenvml.fixtures import FakeNvml
from tests.realkube.chart import (
    AgentIdentity,
    Installed,
    agent_identity,
    chart_values,
    install,
    render_for,
    uninstall,
)
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.kubelet import KubeletServer
from tests.realkube.objects import create_pod, pod, remove_pod, unique, workload
from tests.test_labels_agent import api_requests
from tests.waiting import eventually

NODE = "node-a"  # the stand-in's node


@dataclass
class Release:
    """A release of the chart whose ClusterRole lost a grant, in a namespace of its own."""

    cluster: KubeCluster
    chart: Installed
    full_rules: list[dict[str, Any]]

    def identity(self, directory: Path) -> AgentIdentity:
        """The release's agent pod on a new Node, and its pod-bound token."""
        return agent_identity(self.cluster, self.chart, unique("node"), directory)

    def grant(self) -> None:
        """The chart's whole role, as an upgrade to a fixed release would apply it."""
        name = self.chart.cluster_role["metadata"]["name"]
        self.cluster.admin.merge_patch(
            f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}", {"rules": self.full_rules}
        )


@contextlib.contextmanager
def release_without(
    cluster: KubeCluster, resource: str, verb: str | None = None
) -> Iterator[Release]:
    """The chart installed with `verb` (every verb when None) on `resource` taken out of its
    ClusterRole; uninstalled afterwards."""
    name = unique("gpuid-rbac")
    chart = render_for(cluster, chart_values(), release=name, namespace=name)
    role = chart.cluster_role
    full = copy.deepcopy(role["rules"])
    rules = []
    for rule in role["rules"]:
        if resource in rule["resources"]:
            verbs = [v for v in rule["verbs"] if verb is not None and v != verb]
            if not verbs:
                continue
            rule = {**rule, "verbs": verbs}
        rules.append(rule)
    assert rules != full, f"the chart's role has no {verb or 'rule'} on {resource}"
    role["rules"] = rules
    install(cluster.admin, chart)
    try:
        yield Release(cluster, chart, full)
    finally:
        uninstall(cluster.admin, chart)


@dataclass
class Counted:
    """The agent's API client of a node and its gpuid_kube_api_requests_total."""

    client: KubeClient
    metrics: AgentMetrics

    def requests(self, verb: str, resource: str, code: str | None = None) -> float:
        return sum(
            s.value
            for family in self.metrics.registry.collect()
            if family.name == "gpuid_kube_api_requests"
            for s in family.samples
            if s.name.endswith("_total")
            and (s.labels["verb"], s.labels["resource"]) == (verb, resource)
            and code in (None, s.labels["code"])
        )


@contextlib.asynccontextmanager
async def counted_client(identity: AgentIdentity) -> AsyncIterator[Counted]:
    metrics = AgentMetrics()
    client = await create_kube_client(
        "auto",
        environ={"KUBECONFIG": str(identity.kubeconfig)},
        observer=request_counter(metrics.kube_api_requests),
    )
    assert client is not None
    try:
        yield Counted(client, metrics)
    finally:
        await client.close()


@pytest.fixture
async def agent_client(agent_node: AgentIdentity) -> AsyncIterator[Counted]:
    async with counted_client(agent_node) as counted:
        yield counted


def workloads(admin: Client, namespace: str, node: str) -> dict[str, dict[str, Any]]:
    """One pod per kind of owner on `node`, one pod on another node; the pods by name."""

    def made(obj: dict[str, Any]) -> dict[str, Any]:
        return workload(admin, {**obj, "metadata": {**obj["metadata"], "namespace": namespace}})

    deploy = made(objects.deployment("web"))
    rs = made(objects.replicaset("web-7d4b9c8f6d", owners=[objects.owner(deploy)]))
    cron = made(objects.cronjob("nightly"))
    job = made(objects.job("nightly-28901234", owners=[objects.owner(cron)]))
    bare_job = made(objects.job("once"))
    sts = made(objects.statefulset("db"))
    ds = made(objects.daemonset("agent"))
    web_labels = {"app": "web", "pod-template-hash": "7d4b9c8f6d", "team": "search"}
    specs: dict[str, tuple[dict[str, Any] | None, dict[str, str] | None]] = {
        "web-7d4b9c8f6d-abcde": (objects.owner(rs), web_labels),
        "web-7d4b9c8f6d-fghij": (objects.owner(rs), web_labels),
        "nightly-28901234-xyz": (objects.owner(job), None),
        "once-q8x7z": (objects.owner(bare_job), None),
        "db-0": (objects.owner(sts), {"team": "storage"}),
        "agent-k2j4h": (objects.owner(ds), None),
        "loner": (None, None),
    }
    pods = {
        name: create_pod(admin, pod(namespace, name, node, owner=owner, labels=labels))
        for name, (owner, labels) in specs.items()
    }
    create_pod(admin, pod(namespace, "elsewhere", unique("other-node"), owner=objects.owner(sts)))
    return pods


def cache_for(node: str, **kwargs: Any) -> PodCache:
    return PodCache(node, label_allowlist=["team", "absent"], **kwargs)


async def running(cache: PodCache, client: KubeClient) -> asyncio.Task[None]:
    assert cache.open(client)
    task = asyncio.create_task(cache.run())
    await eventually(lambda: cache.ready)
    return task


async def stop(cache: PodCache, task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_every_owner_kind_and_one_read_per_owner(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, agent_client: Counted
) -> None:
    ns = unique("team")
    pods = workloads(kube_cluster.admin, ns, agent_node.node)
    cache = cache_for(agent_node.node)
    task = await running(cache, agent_client.client)
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
            meta = cache.lookup(ns, name)
            assert meta is not None, name
            assert (meta.workload_kind, meta.workload_name) == (kind, owner), name
            assert meta.uid == pods[name]["metadata"]["uid"]
        # another node's pod: the list's field selector left it out (the cache keeps what the
        # server sends)
        assert cache.lookup(ns, "elsewhere") is None
        assert dict(cache.lookup(ns, "db-0").labels) == {"team": "storage"}  # type: ignore[union-attr]
        # two pods of one ReplicaSet: its owner is read once; the bare Job and the CronJob's
        # Job once each; StatefulSet and DaemonSet owners need no read
        assert agent_client.requests("get", "replicasets", "200") == 1
        assert agent_client.requests("get", "jobs", "200") == 2
        assert agent_client.requests("list", "pods", "200") == 1
        assert cache.board.is_ok("kube-pods")
    finally:
        await stop(cache, task)


async def test_watch_follows_changes(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, agent_client: Counted
) -> None:
    admin, ns, node = kube_cluster.admin, unique("team"), agent_node.node
    sts = workload(admin, objects.statefulset("db", namespace=ns))
    create_pod(admin, pod(ns, "db-0", node, owner=objects.owner(sts)))
    cache = cache_for(node)
    task = await running(cache, agent_client.client)
    try:
        cache.changed.clear()
        create_pod(admin, pod(ns, "db-1", node, owner=objects.owner(sts)))
        await eventually(lambda: cache.lookup(ns, "db-1"))
        assert cache.changed.is_set()
        assert cache.lookup(ns, "db-1").workload_kind == "StatefulSet"  # type: ignore[union-attr]
        admin.merge_patch(
            f"/api/v1/namespaces/{ns}/pods/db-1", {"metadata": {"labels": {"team": "blue"}}}
        )
        await eventually(lambda: cache.lookup(ns, "db-1").labels.get("team") == "blue")  # type: ignore[union-attr]
        remove_pod(admin, ns, "db-1")
        # db-0 and the agent's own pod, which runs on this node too
        await eventually(lambda: cache.status()["pods"] == 2)
        # a deleted pod's metadata stays readable while its containers may still hold GPUs
        assert cache.lookup(ns, "db-1") is not None
        assert agent_client.requests("list", "pods") == 1  # followed, never listed again
    finally:
        await stop(cache, task)


async def test_forbidden_list_leaves_the_kubelet_alone_in_charge(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    with release_without(kube_cluster, "pods") as release:
        identity = release.identity(tmp_path)
        async with counted_client(identity) as counted:
            cache = cache_for(identity.node, backoff_max=0.05)
            task = await running(cache, counted.client)
            try:
                state = cache.board.get("kube-pods")
                # unavailable at first; a retry (full jitter: possibly at once) may say degraded
                assert state is not None and state.state in ("unavailable", "degraded")
                assert "forbidden" in (state.reason or "")
                assert counted.requests("list", "pods", "403") >= 1
                ns = unique("team")
                create_pod(kube_cluster.admin, pod(ns, "early", identity.node))
                assert cache.lookup(ns, "early") is None
                release.grant()  # RBAC fixed: the cache recovers on its own
                create_pod(kube_cluster.admin, pod(ns, "late", identity.node))
                await eventually(lambda: cache.lookup(ns, "late"))
                assert cache.lookup(ns, "early") is not None
                assert cache.board.is_ok("kube-pods")
            finally:
                await stop(cache, task)


async def test_forbidden_replicaset_read_still_names_the_deployment(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    with release_without(kube_cluster, "replicasets") as release:
        identity = release.identity(tmp_path)
        ns = unique("team")
        pods = workloads(kube_cluster.admin, ns, identity.node)
        async with counted_client(identity) as counted:
            cache = cache_for(identity.node)
            task = await running(cache, counted.client)
            try:
                meta = cache.lookup(ns, "web-7d4b9c8f6d-abcde")
                assert meta is not None and (meta.workload_kind, meta.workload_name) == (
                    "Deployment",
                    "web",
                )
                assert meta.uid == pods["web-7d4b9c8f6d-abcde"]["metadata"]["uid"]
                forbidden = cache.registry.get_sample_value(
                    "gpuid_owner_lookups_total", {"outcome": "forbidden"}
                )
                assert forbidden == 1  # remembered, not asked again for the second pod
                assert counted.requests("get", "replicasets") == 1
                assert counted.requests("get", "replicasets", "403") == 1
            finally:
                await stop(cache, task)


async def test_no_configuration_means_ready_without_the_api() -> None:
    cache = PodCache(NODE)
    assert not cache.open(None)
    assert cache.ready and cache.lookup("default", "x") is None
    state = cache.board.get("kube-pods")
    assert state is not None and state.state == "unavailable"


def pod_requests(agent: Agent) -> float:
    """Requests about pods and their owners (other parts of the agent read the Node)."""
    return sum(api_requests(agent, resource=r) for r in ("pods", "replicasets", "jobs"))


async def test_agent_labels_and_trail_carry_the_workload(
    fake_nvml: FakeNvml,
    real_kubelet: KubeletServer,
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(agent_node.kubeconfig))
    ns = unique("team")
    pods = workloads(kube_cluster.admin, ns, agent_node.node)
    config = fakenvml.h100x8()
    fake_nvml.apply(config)
    real_kubelet.pods = [
        kubelet_pod(
            ns, "web-7d4b9c8f6d-abcde", "main", "nvidia.com/gpu", config.gpus[0].uuid or ""
        ),
        kubelet_pod(ns, "db-0", "main", "nvidia.com/gpu", config.gpus[1].uuid or ""),
        # known to the kubelet only (no pod on the API server)
        kubelet_pod(ns, "ghost", "main", "nvidia.com/gpu", config.gpus[2].uuid or ""),
    ]
    real_kubelet.publish()
    out = io.BytesIO()
    s = settings(
        node_name=agent_node.node,
        kube_api="auto",
        pod_resources_socket=real_kubelet.socket_path,
        pod_resources_interval=0.05,
        pod_label_allowlist="team,app.kubernetes.io/name",
    )
    agent = Agent(s, nvml_api=PynvmlApi(str(fake_nvml.lib_path)), exporters=[StdoutExporter(out)])
    async with running_agent(agent), aiohttp.ClientSession() as http:
        await eventually(lambda: out.getvalue().count(b'"kind":"allocation"') >= 3)
        url = f"http://127.0.0.1:{agent.bound_port}/gpu/metrics"
        await eventually(lambda: serves(agent, b'workload_name="web"'))
        # the watch is counted once its answer starts, which may follow the first attribution
        await eventually(lambda: api_requests(agent, "watch", "pods", "200") == 1)
        before = pod_requests(agent)
        for _ in range(10):
            async with http.get(url) as resp:
                text = await resp.text()
        assert pod_requests(agent) == before  # a scrape asks the API nothing
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


# ---- faults only the stand-in makes ----------------------------------------------------------


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(token="t0ken") as server:
        yield server


@pytest.fixture
async def client(kube: FakeKube, tmp_path: Path) -> AsyncIterator[KubeClient]:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube.url, token="t0ken")
    found = await create_kube_client("auto", environ={"KUBECONFIG": str(kubeconfig)})
    assert found is not None
    yield found
    await found.close()


async def test_watch_resumes_after_the_server_ends_it_and_after_410(
    kube: FakeKube, client: KubeClient
) -> None:
    sts = kube.create(objects.statefulset("db"))
    kube.create(objects.pod("db-0", node_name=NODE, owners=[objects.owner(sts)]))
    cache = cache_for(NODE, watch_timeout=30)
    task = await running(cache, client)
    try:
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
        await eventually(lambda: cache.status()["pods"] == 1)
        # a deleted pod's metadata stays readable while its containers may still hold GPUs
        assert cache.lookup("default", "db-2") is not None
    finally:
        await stop(cache, task)
