"""The agent with labelling wired in: a simulated node, the real client, the real API server.

On the real kube-apiserver (the chart's RBAC and own-node policy, the agent's pod-bound token):
labels and the machine from the Node's providerID, labels off (the Node read, never patched),
one counted client for labels, pods and conditions. Requests are counted by the agent's own
`gpuid_kube_api_requests_total`.

On the stand-in (`tests/fakekube`), for what the real server cannot be made to do: an API
server that comes up after the agent started
(`test_machine_switches_to_provider_id_when_the_api_comes_up`), and KUBE_API=off making no
request at all, which only a server-side request log proves (`test_kube_api_off_makes_no_requests`:
the agent's metric counts only what its own client sends). A broken kubeconfig needs no server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuid_agent.agent import Agent
from gpuid_agent.delivery.exporters.base import BatchMeta, Exporter
from gpuid_agent.records.types import AnyRecord
from tests.conftest import running_agent, settings
from tests.fakekube import FakeKube, free_port, write_kubeconfig
from tests.realkube.chart import AgentIdentity, Installed, agent_identity
from tests.realkube.cluster import KubeCluster
from tests.realkube.objects import node, unique
from tests.waiting import eventually

P = "gpuid.github.com"
NODE = "node-a"
AWS = "aws:///us-east-1a/i-0123456789abcdef0"


class Collect(Exporter):
    name = "collect"

    def __init__(self) -> None:
        self.records: list[AnyRecord] = []

    async def export(self, batch: Sequence[AnyRecord], meta: BatchMeta | None = None) -> None:
        self.records.extend(batch)


@pytest.fixture(autouse=True)
def _not_in_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    # the test environment must not look like a pod (in-cluster config would win)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    async with FakeKube() as server:
        monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", server.url)))
        yield server


def identity_on(
    cluster: KubeCluster,
    chart: Installed,
    directory: Path,
    monkeypatch: pytest.MonkeyPatch,
    provider_id: str | None = None,
) -> AgentIdentity:
    """A new Node (with `provider_id`, as the cloud's node controller sets it) and the chart's
    agent pod on it; KUBECONFIG holds that pod's token."""
    name = unique("node")
    cluster.admin.create("/api/v1/nodes", node(name, provider_id=provider_id))
    identity = agent_identity(cluster, chart, name, directory)
    monkeypatch.setenv("KUBECONFIG", str(identity.kubeconfig))
    return identity


def node_labels(cluster: KubeCluster, name: str) -> dict[str, str]:
    return dict(cluster.admin.get(f"/api/v1/nodes/{name}")["metadata"]["labels"])


def api_requests(
    agent: Agent, verb: str | None = None, resource: str | None = None, code: str | None = None
) -> float:
    """Requests the agent's client sent, from its own gpuid_kube_api_requests_total."""
    wanted = {"verb": verb, "resource": resource, "code": code}
    return sum(
        s.value
        for family in agent.metrics.registry.collect()
        if family.name == "gpuid_kube_api_requests"
        for s in family.samples
        if s.name.endswith("_total")
        and all(v is None or s.labels[k] == v for k, v in wanted.items())
    )


def agent_settings(**overrides: Any) -> Any:
    base: dict[str, Any] = {
        "simulate": "gb200x4",
        "kube_api": "auto",
        "labels": "on",
        "label_startup_jitter": 0,
        "label_resync_interval": 0.3,
        # reading records only: no simulated kubelet, so no allocation records in the sink
        "pod_resources_socket": "/nonexistent/kubelet.sock",
    }
    base.update(overrides)
    return settings(**base)


async def _get_json(agent: Agent, path: str) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{agent.bound_port}{path}") as resp,
    ):
        return await resp.json()


async def test_agent_labels_its_node_and_takes_machine_from_provider_id(
    kube_cluster: KubeCluster,
    chart_installed: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    identity = identity_on(kube_cluster, chart_installed, tmp_path, monkeypatch, AWS)
    name = identity.node
    sink = Collect()
    async with running_agent(Agent(agent_settings(node_name=name), exporters=[sink])) as agent:
        await eventually(lambda: node_labels(kube_cluster, name).get(f"{P}/gpu-count") == "4")
        labels = node_labels(kube_cluster, name)
        assert labels["kubernetes.io/hostname"] == name
        assert f"{P}/chassis" in labels
        assert {f"{P}/gpu-0", f"{P}/gpu-1"} <= set(labels)
        assert agent.identity.machine == "i-0123456789abcdef0"
        await eventually(lambda: len(sink.records) >= 4)
        await eventually(lambda: agent.board.is_ok("labels"))  # the PATCH answer is in
        assert {r.machine for r in sink.records} == {"i-0123456789abcdef0"}
        assert {r.machine_source for r in sink.records} == {"provider_id:aws"}
        status = await _get_json(agent, "/status")
        assert status["machine"] == {"id": "i-0123456789abcdef0", "source": "provider_id:aws"}
        assert status["components"]["labels"]["state"] == "ok"
        assert status["labels"]["desired"] == {
            k: v for k, v in labels.items() if k.startswith(f"{P}/")
        }
        assert status["ready"] is True
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{agent.bound_port}/metrics") as resp,
        ):
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        requests = families["gpuid_kube_api_requests"].samples
        assert any(
            s.labels == {"verb": "patch", "resource": "nodes", "code": "200"} for s in requests
        )
        assert families["gpuid_label_patches"].samples
    assert api_requests(agent, "patch") == 1  # collections every 0.05 s, one patch


async def test_machine_switches_to_provider_id_when_the_api_comes_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv(
        "KUBECONFIG", str(write_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}"))
    )
    kube = FakeKube(port=port)
    sink = Collect()
    s = agent_settings()
    try:
        async with running_agent(Agent(s, exporters=[sink])) as agent:
            await eventually(lambda: len(sink.records) >= 4)
            assert {r.machine for r in sink.records} == {"sim-node-a"}
            assert agent.board.get("labels").state == "degraded"  # type: ignore[union-attr]
            await kube.start()
            kube.add_node(NODE, provider_id=AWS)
            await eventually(lambda: f"{P}/chassis" in kube.node_labels(NODE))
            await eventually(lambda: len(sink.records) >= 8)
            changed = sink.records[4:8]
            assert {r.machine for r in changed} == {"i-0123456789abcdef0"}
            assert {r.reason for r in changed} == {"change"}
    finally:
        await kube.stop()


async def test_labels_off_reads_provider_id_but_never_patches(
    kube_cluster: KubeCluster,
    chart_installed: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gce = "gce://proj/us-central1-a/gke-gpu-1"
    identity = identity_on(kube_cluster, chart_installed, tmp_path, monkeypatch, gce)
    before = node_labels(kube_cluster, identity.node)
    s = agent_settings(labels="off", node_name=identity.node)
    async with running_agent(Agent(s, exporters=[Collect()])) as agent:
        await eventually(lambda: agent.bus.latest is not None)
        assert agent.identity.machine == "gke-gpu-1"
        assert agent.board.get("labels").state == "disabled"  # type: ignore[union-attr]
    assert api_requests(agent, "patch") == 0
    assert api_requests(agent, "get") == api_requests(agent, "get", "nodes", "200") == 1
    assert node_labels(kube_cluster, identity.node) == before


async def test_kube_api_off_makes_no_requests(kube: FakeKube) -> None:
    kube.add_node(NODE, provider_id=AWS)
    s = agent_settings(kube_api="off")
    async with running_agent(Agent(s, exporters=[Collect()])) as agent:
        await eventually(lambda: agent.bus.latest is not None)
        status = await _get_json(agent, "/status")
    assert kube.requests == []
    assert status["machine"]["source"] == "simulated"
    assert status["components"]["labels"] == {
        "state": "disabled",
        "reason": "KUBE_API=off",
        "since": status["components"]["labels"]["since"],
    }


async def test_broken_kubeconfig_is_reported_not_fatal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "kc"
    bad.write_text("users: [oops")
    monkeypatch.setenv("KUBECONFIG", str(bad))
    async with running_agent(Agent(agent_settings(), exporters=[Collect()])) as agent:
        await eventually(lambda: agent.bus.latest is not None)
        api = agent.board.get("kube_api")
        assert api is not None
        assert api.state == "unavailable"
        assert "unusable" in (api.reason or "")
        ready, _ = agent.page.readiness()
        assert ready  # labelling trouble does not take the agent out of service


async def test_one_counted_api_client_serves_labels_pods_and_conditions(
    kube_cluster: KubeCluster,
    chart_with_conditions: Installed,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    identity = identity_on(kube_cluster, chart_with_conditions, tmp_path, monkeypatch, AWS)
    name = identity.node
    s = agent_settings(node_conditions=True, fault="xid79:gpu2", node_name=name)
    async with running_agent(Agent(s, exporters=[Collect()])) as agent:
        await eventually(lambda: node_labels(kube_cluster, name).get(f"{P}/gpu-count") == "4")
        assert agent.pods is not None
        await eventually(lambda: agent.pods.ready)  # type: ignore[union-attr]
        await eventually(lambda: agent.conditions is not None and agent.conditions.writes > 0)
        counted = {
            (s.labels["verb"], s.labels["resource"])
            for family in agent.metrics.registry.collect()
            if family.name == "gpuid_kube_api_requests"
            for s in family.samples
            if s.name.endswith("_total") and s.value > 0
        }
        # pods (list/watch), labels (node get/patch) and conditions (nodes/status) all counted
        assert any(resource == "pods" for _, resource in counted), counted
        assert any(resource.startswith("nodes/status") for _, resource in counted), counted
        assert agent.pods._client is agent.labelling.kube  # type: ignore[union-attr]
        # nothing was refused by the chart's RBAC or its own-node policy (a 409 may come: the
        # agent's own status write moves the Node between its label read and its patch)
        assert api_requests(agent, code="403") == api_requests(agent, code="401") == 0
