"""The pod cache's list+watch against the real API server, with the agent's pod-bound token and
the chart's RBAC: owners walked through real ReplicaSets and Jobs, watches the server ends with
no events, bookmarks, and a 410 after an etcd compaction, without missing a pod change."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpuid_agent.sources.kube.client import KubeClient, create_kube_client
from gpuid_agent.sources.kube.pods import PodCache
from tests.fakekube import objects as build
from tests.realkube.chart import AgentIdentity, write_kubeconfig
from tests.realkube.cluster import Client, KubeCluster
from tests.realkube.objects import create_pod, pod, remove_pod, unique, workload
from tests.waiting import eventually


class Requests(Counter[tuple[str, str, str]]):
    """Every request the agent's client made, by (verb, resource, code)."""

    def observe(self, verb: str, resource: str, code: str) -> None:
        self[(verb, resource, code)] += 1

    def count(self, verb: str, resource: str = "pods") -> int:
        return sum(n for (v, r, _), n in self.items() if (v, r) == (verb, resource))


@pytest.fixture
def requests() -> Requests:
    return Requests()


async def agent_client(kubeconfig: Path, requests: Requests) -> KubeClient:
    client = await create_kube_client(
        "auto", environ={"KUBECONFIG": str(kubeconfig)}, observer=requests.observe
    )
    assert client is not None
    return client


@pytest.fixture
async def client(agent_node: AgentIdentity, requests: Requests) -> AsyncIterator[KubeClient]:
    found = await agent_client(agent_node.kubeconfig, requests)
    yield found
    await found.close()


@pytest.fixture(scope="module")
def uncached_apiserver(kube_cluster: KubeCluster) -> Iterator[Client]:
    """A second API server on the same etcd with its watch cache off: watches then read etcd
    directly, so a compaction reaches them as it does for resources served without a cache."""
    with kube_cluster.second_apiserver("--watch-cache=false") as client:
        yield client


async def running(cache: PodCache, client: KubeClient) -> asyncio.Task[None]:
    assert cache.open(client)
    task = asyncio.create_task(cache.run())
    await eventually(lambda: cache.ready)
    return task


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def relists(cache: PodCache) -> float:
    return cache.registry.get_sample_value("gpuid_pod_cache_relists_total") or 0


async def test_owners_and_watches_the_server_ends(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, client: KubeClient, requests: Requests
) -> None:
    admin, ns, node = kube_cluster.admin, unique("team"), agent_node.node
    deploy = workload(admin, build.deployment("web", namespace=ns))
    rs = workload(
        admin, build.replicaset("web-7d4b9c8f6d", namespace=ns, owners=[build.owner(deploy)])
    )
    cron = workload(admin, build.cronjob("nightly", namespace=ns))
    job = workload(admin, build.job("nightly-28901234", namespace=ns, owners=[build.owner(cron)]))
    create_pod(
        admin,
        pod(ns, "web-7d4b9c8f6d-abcde", node, owner=build.owner(rs), labels={"team": "search"}),
    )
    create_pod(admin, pod(ns, "nightly-28901234-xyz", node, owner=build.owner(job)))
    create_pod(admin, pod(ns, "elsewhere", unique("other-node")))
    cache = PodCache(node, label_allowlist=["team"], watch_timeout=2)
    task = await running(cache, client)
    try:
        web = cache.lookup(ns, "web-7d4b9c8f6d-abcde")
        assert web is not None and (web.workload_kind, web.workload_name) == ("Deployment", "web")
        assert dict(web.labels) == {"team": "search"}
        nightly = cache.lookup(ns, "nightly-28901234-xyz")
        assert nightly is not None and (nightly.workload_kind, nightly.workload_name) == (
            "CronJob",
            "nightly",
        )
        assert cache.lookup(ns, "elsewhere") is None
        # The server ends each 2 s watch, often with no event: resumed, never listed again.
        await eventually(lambda: requests.count("watch") >= 3, within=30)
        create_pod(admin, pod(ns, "late", node))
        await eventually(lambda: cache.lookup(ns, "late"))
        remove_pod(admin, ns, "web-7d4b9c8f6d-abcde")
        # Left: nightly, late, and the agent's own pod, which runs on this node too.
        await eventually(lambda: cache.status()["pods"] == 3)
        assert relists(cache) == 1
        assert cache.board.is_ok("kube-pods")
        # Nothing the agent asked for was refused by the chart's RBAC.
        assert not [key for key in requests if key[2] != "200"], requests
        assert requests.count("get", "replicasets") == 1 and requests.count("get", "jobs") == 1
    finally:
        await stopped(task)


async def test_bookmarks_move_the_resume_point_past_other_nodes_churn(
    kube_cluster: KubeCluster, agent_node: AgentIdentity, client: KubeClient
) -> None:
    admin, ns = kube_cluster.admin, unique("team")
    create_pod(admin, pod(ns, "mine", agent_node.node))
    cache = PodCache(agent_node.node, watch_timeout=4)
    task = await running(cache, client)
    try:
        listed_at = int(cache.resource_version or 0)
        elsewhere = unique("other-node")
        for i in range(5):
            create_pod(admin, pod(ns, f"elsewhere-{i}", elsewhere))
        # No event of this node since the list; the watch cache's bookmark (sent before the
        # watch's deadline) still carries the newer resourceVersion.
        await eventually(lambda: int(cache.resource_version or 0) > listed_at + 5, within=30)
        assert relists(cache) == 1
    finally:
        await stopped(task)


async def test_resuming_after_a_compaction_lists_again_and_misses_nothing(
    kube_cluster: KubeCluster,
    agent_node: AgentIdentity,
    uncached_apiserver: Client,
    requests: Requests,
    tmp_path: Path,
) -> None:
    admin, ns, node = kube_cluster.admin, unique("team"), agent_node.node
    create_pod(admin, pod(ns, "before", node))
    kubeconfig = write_kubeconfig(
        tmp_path / "kc", uncached_apiserver.url, kube_cluster.ca_path, agent_node.token
    )
    client = await agent_client(kubeconfig, requests)
    cache = PodCache(node, watch_timeout=30)
    try:
        task = await running(cache, client)
        await stopped(task)  # the agent's connection is down…
        stale = cache.resource_version
        remove_pod(admin, ns, "before")
        create_pod(admin, pod(ns, "while-away", node))
        kube_cluster.compact()  # …while the history it would resume from is compacted
        task = asyncio.create_task(cache.run())
        await eventually(lambda: cache.lookup(ns, "while-away"))
        assert relists(cache) == 2
        assert cache.resource_version != stale
        await eventually(lambda: cache.status()["pods"] == 2)  # while-away and the agent's
        assert cache.board.is_ok("kube-pods")
        await stopped(task)
    finally:
        await client.close()
